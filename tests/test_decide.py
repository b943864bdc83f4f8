"""kernels.comm.decide: one variant choice per problem, rank 0's, on every rank.

Over a real process group (gloo, two processes on the CPU: the broadcast path GPU runs take)
and in simulated worlds (where the all-gather + GEMM launcher is driven end to end with ranks
whose own decision functions disagree)."""
import textwrap
import threading

import pytest
import torch

from kernels.ag_gemm import all_gather_matmul, launch as aglaunch
from kernels.comm.decide import shared_choice
from workbench import dist

SCRIPT = textwrap.dedent('''
    import torch
    from kernels.comm.decide import shared_choice
    from workbench import dist

    class Heap:   # what shared_choice reads of a SymmetricHeap
        simulated = False
        group = None
        device = torch.device("cpu")

        def __init__(self, rank, world_size):
            self.rank, self.world_size, self._c = rank, world_size, {}

        def cache(self, name):
            return self._c.setdefault(name, {})

    with dist.worker() as w:
        heap = Heap(w.rank, w.world_size)
        asked = []

        def mine(problem):   # each rank's own table says something else
            asked.append(problem)
            return {"variant": f"choice of rank {w.rank}", "problem": problem}

        got = [shared_choice(heap, "fam", p, lambda p=p: mine(p)) for p in ((1, 2), (3, 4), (1, 2))]
        w.emit({"got": got, "asked": asked})
''')


def test_rank_zeros_choice_is_broadcast_once_per_problem(tmp_path):
    script = tmp_path / "decide.py"
    script.write_text(SCRIPT)
    res = dist.launch(script, 2, [], timeout_s=120, run_dir=tmp_path / "run", backend="gloo")
    rows = {r["rank"]: r for r in res.rows}
    for r in (0, 1):
        assert [g["variant"] for g in rows[r]["got"]] == ["choice of rank 0"] * 3
        assert [tuple(g["problem"]) for g in rows[r]["got"]] == [(1, 2), (3, 4), (1, 2)]
    assert [tuple(p) for p in rows[0]["asked"]] == [(1, 2), (3, 4)]   # a known problem is not asked again
    assert rows[1]["asked"] == []                                       # rank 1's own choice is never used


def test_simulated_world_waits_for_rank_zero():
    """Rank 1 asks first; it gets rank 0's decision once rank 0 has made it."""
    world = dist.SimulatedWorld(2, heap_bytes=1 << 14)
    order = []

    def body(h):
        if h.rank == 0:
            threading.Event().wait(0.2)   # rank 0 comes late
        return shared_choice(h, "fam", ("p",), lambda: order.append(h.rank) or f"rank {h.rank}'s")

    assert world.run(body) == ["rank 0's", "rank 0's"] and order == [0]


SIM = aglaunch.AgGemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=1, fetchers=2,
                            k_per_flag=1, num_sms=5, ce_chunks=2)


@pytest.mark.parametrize("W", [2, 3, 4])
def test_all_gather_matmul_runs_rank_zeros_variant_when_tables_differ(W, monkeypatch):
    """Rank 1's own decision function picks copy_engine, every other rank's pipelined (as if rank
    1 read another tuning table): every rank runs pipelined, the choice made once per problem
    by rank 0 alone, and C equals the reference on every rank (poisoned first), both gather dims."""
    from kernels.ag_gemm.reference import reference, tolerance

    calls = []

    def local_choice(M, N, K, world_size, gather_dim, sms, simulated=False, dtype=None, mode="eager"):
        me = threading.current_thread().name
        calls.append(me)
        return SIM.replace(variant="copy_engine" if me == "sim-rank1" else "pipelined")

    monkeypatch.setattr(aglaunch, "auto_config", local_choice)
    world = dist.SimulatedWorld(W, heap_bytes=1 << 19)
    g = torch.Generator().manual_seed(W)
    for gd, (S_M, S_K) in ((0, (7, 37)), (1, (19, 13))):
        K = S_K * W if gd == 1 else S_K
        shards = [torch.randn(S_M, S_K, generator=g).to(torch.bfloat16) for _ in range(W)]
        b = torch.randn(K, 21, generator=g).to(torch.bfloat16)
        for _ in range(2):
            def body(h):
                out = torch.full((S_M * (W if gd == 0 else 1), 21), float("nan"), dtype=torch.bfloat16)
                return all_gather_matmul(shards[h.rank], b, h, gather_dim=gd, out=out).clone()

            outs = world.run(body)
            ref = reference(shards, b, gd)
            atol, rtol = tolerance(torch.bfloat16, K)
            for c in outs:
                torch.testing.assert_close(c.double(), ref, atol=atol, rtol=rtol)
        plans = [aglaunch.get_plan(shards[h.rank], b, h, gather_dim=gd) for h in world.heaps]
        assert {p.cfg.variant for p in plans} == {"pipelined"}
    assert calls == ["sim-rank0"] * 4   # two problems, each decided once by rank 0 (for eager calls and graph replays)


class _Heap:   # what shared_choice reads of a SymmetricHeap, one rank of a world of two
    simulated, group, rank, world_size = False, None, 0, 2
    device = torch.device("cpu")

    def __init__(self):
        self._c = {}

    def cache(self, name):
        return self._c.setdefault(name, {})


def test_a_new_problem_inside_a_graph_capture_is_refused_clearly(monkeypatch):
    """A broadcast cannot run inside a CUDA graph capture (it failed as 'Cannot copy between CPU
    and CUDA tensors during CUDA graph capture'): a first call there says what to do instead; a
    problem decided before the capture is a lookup and passes."""
    from kernels.comm import decide

    heap = _Heap()
    monkeypatch.setattr(decide, "_broadcast_from_rank0", lambda h, d: d())
    assert shared_choice(heap, "fam", ("known",), lambda: "rank 0's") == "rank 0's"
    monkeypatch.setattr(decide, "_capturing", lambda: True)
    assert shared_choice(heap, "fam", ("known",), lambda: "other") == "rank 0's"
    with pytest.raises(RuntimeError, match="before capturing"):
        shared_choice(heap, "fam", ("new",), lambda: "x")
    assert ("new",) not in heap.cache("fam.decisions")
