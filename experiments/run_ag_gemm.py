"""Fused all-gather + GEMM on a multi-GPU node, in one command per world size:
correctness first, then every variant and baseline timed eager and graph-replayed
with random inputs, fetcher-count / staging-layout / flag-group sweeps, a trace,
and the auto-config refit.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc-per-node 2 experiments/run_ag_gemm.py --out results/ag_gemm/
    python experiments/run_ag_gemm.py --world-sizes 2 --out results/ag_gemm/     # the same via workbench.dist.launch
    python experiments/run_ag_gemm.py --world-sizes 4 --out results/ag_gemm/w4/ \
        --auto-table results/ag_gemm/auto_table.json     # 4 and 8 GPUs likewise (w8/): one table for all

(This file sets the three multicast switches itself before NCCL starts, so plain
``torchrun`` is safe too; the prefix also covers torchrun's own process.)

Shapes (the seed's table): M in {1024, 4096, 16384} with N=3584, K=8192; and
4096x4096x4096, 4096x11008x4096, 4096x14336x4096; bf16; both conventions
(gather_dim=1: each rank holds A[:, K/W slice]; gather_dim=0: M/W rows each).

``--shape-set llm`` / ``llm-reduced``: the LLM tensor-parallel set of
``experiments/overlap.py`` instead (Llama-3 70B/405B, Qwen2.5/3, DeepSeek-V3 dense
layers; M = tokens), our variants by name beside every baseline, and a variant choice
fitted on the set's fit half and scored on its held-out half (auto_table.json,
held_out.csv, variant_choice.csv; no sweeps or traces). ``summary.csv`` has, per shape,
each method's comm hidden = (T_gemm + T_comm - T) / T_comm (T_gemm: ``gemm_alone``,
T_comm: ``nccl_all_gather``) and the best of ours against the best library.
``experiments/run_overlap.py`` runs the reduced set at 2 ranks with the tests.

Methods: ours ``fused`` (SM fetchers), ``copy_engine``, ``chunked`` (copy-engine
copies; cuBLAS per shard as it lands along M, per row chunk over the whole K as its rows
of every shard land along K), ``chunked_sum`` (along K only: cuBLAS per shard as it
lands, the products summed in fp32), ``pipelined`` (copy-engine
chunks, a signal each, our GEMM in arrival order), ``sequential`` (our
all-gather + our GEMM), ``auto`` (what ``config=None`` picks: the row says which
variant, whether it fell back to sequential, and whether its rule was measured or
the placeholder); baselines ``nccl_cublas`` (all_gather_into_tensor + cuBLAS, the
shards laid out as the convention says), ``torch_fused``
(torch.ops.symm_mem.fused_all_gather_matmul), ``gemm_alone`` (cuBLAS on the
gathered A: the floor) and ``nccl_all_gather`` (the gather alone).

Every point is checked against an fp32 product of the NCCL-gathered A before it
is timed (and called twice, then replayed once from a CUDA graph: ours must give
identical bits). Output in --out:
bench.csv, sweeps.csv, checks.csv, trace.csv, summary.csv (every row with
provenance) and auto_table.json (the measured auto-config that
kernels/ag_gemm/config.py reads from results/ag_gemm/; ``--auto-table`` names
another file, to which a run adds its world sizes' entries, keeping the others). ``--check-only``: the
checks alone (the multigpu test). NVLink multicast stays off in every process.

``--quick``: the first two shapes (the sweeps and the trace included: their shape
is the second). ``--budget-s``: start no case or sweep point after that many
seconds in a world (what is left is listed in skipped.csv); ``--timeout`` kills a
world that runs longer (a hang). Started without torchrun, the exit status is 1
when a world failed or hung, or a check missed its tolerance (the tables written
stay), so a caller (``notebooks/05_all_gather_gemm.ipynb`` measuring afresh) sees it.

Each rank marks what it is doing as its stage (the heap, each check, each timing pass
of each method, each sweep point), so a world that hangs past ``--timeout`` is named
by the step it hung in. What the two overlap studies do alike (timing passes, the fit /
held-out split, the choice tables) is ``experiments/overlap.py``'s.
"""
import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "experiments"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from workbench import dist  # noqa: E402  (sets NVLink multicast off before anything else)
import overlap  # noqa: E402  (experiments/overlap.py: the overlap studies' driver)

SHAPES = [(1024, 3584, 8192), (4096, 3584, 8192), (16384, 3584, 8192), (4096, 4096, 4096), (4096, 11008, 4096),
          (4096, 14336, 4096)]
SWEEP_SHAPE = (4096, 3584, 8192)
# traced (gather_dim 0): the sweeps' shape, and M 1024, where each GEMM program has about one tile
TRACE_SHAPES = (SWEEP_SHAPE, (1024, 3584, 8192))
FETCHERS = (4, 8, 16, 32, 64)
K_PER_FLAG = (2, 8, 32)
WAIT_GROWTH = (1, 2, 4)  # spans of k-groups a GEMM program waits on: 1, g, g^2, ... (swept at TRACE_SHAPES)
# The fused family (the auto-config's fit chooses among them, our sequential path and NCCL + cuBLAS).
FUSED = ("fused", "fused_by_k", "fused_f32", "copy_engine", "chunked", "chunked_sum", "pipelined")
# --shape-set llm / llm-reduced: the variants by name (no fetcher-count or staging studies)
FUSED_LLM = ("fused", "copy_engine", "chunked", "chunked_sum", "pipelined")
# what the variant choice picks from: ours, and the libraries through our launcher's fallbacks
# (nccl_cublas: variant "nccl"; torch_fused: variant "torch", PyTorch's fused op), so that a user
# calling all_gather_matmul gets the fastest way whichever it is
CHOICES = FUSED + ("sequential", "nccl_cublas", "torch_fused")
LIBRARY_VARIANT = {"nccl_cublas": {"variant": "nccl"}, "torch_fused": {"variant": "torch"}}
# *_resident: fused kernels on a shard that already lies in the heap (a producer wrote it
# there), which the peers read in place: no publish copy. Another input contract, so they are
# reported beside the others and never enter the auto-config's fit.
RESIDENT = ("fused_resident", "copy_engine_resident")
OURS = FUSED + ("sequential", "auto") + RESIDENT
LIBRARY = ("nccl_cublas", "torch_fused", "gemm_alone")  # the baselines: timed even where inaccurate
PASSES = 4  # the bench times each case's methods in this many passes, the order rotating (time_all)


def _base_variant(name: str) -> str:
    """The variant a check row's name extends: 'copy_engine+bias' -> 'copy_engine'."""
    return name.split("+")[0].split("_layout")[0]


# --------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------
class Rank:
    def __init__(self, w, args):
        import torch
        import torch.distributed as tdist

        from kernels import ag_gemm

        self.w, self.args, self.torch, self.tdist, self.ag = w, args, torch, tdist, ag_gemm
        self.rank, self.W = tdist.get_rank(), tdist.get_world_size()
        self.rows = []
        self.accurate = {}   # method -> whether its last check was within the tolerance
        self.t0 = time.time()
        self.skipped = 0  # (shape, convention) cases and sweep points the time budget left out
        self.dtype = torch.bfloat16
        self.sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        shapes = self.shapes()
        biggest = max(M * K for M, _, K, _ in shapes) * 2
        self.w.stage("symmetric heap")
        # the fused kernels' pub buffer (one shard, A / W), the resident shard (another) and the
        # sequential path's gathered A (W shards) live in the heap together
        self.heap = dist.SymmetricHeap(biggest * (self.W + 2) // self.W + (64 << 20))

    def shapes(self):
        """[(M, N, K, extra row fields)]: --shapes, the LLM set (layer and fit / held-out split), or the seed's."""
        if getattr(self.args, "shapes", None):
            return [(*s, {}) for s in parse_shapes(self.args.shapes)]
        if getattr(self.args, "shape_set", "seed") in overlap.SET_NAMES:
            return [(r["M"], r["N"], r["K"], {"layer": r["layer"], "split": r["split"]})
                    for r in overlap.shapes("ag_gemm", self.W, self.args.shape_set,
                                            getattr(self.args, "random_shapes", 0),
                                            getattr(self.args, "random_seed", None))]
        return [(*s, {}) for s in (SHAPES[:2] if self.args.quick else SHAPES)]

    def emit(self, row):
        row = {"world_size": self.W, **row}
        self.rows.append({"rank": self.rank, **row})
        self.w.emit(row)

    # inputs -----------------------------------------------------------------
    def inputs(self, M, N, K, gd, seed):
        torch = self.torch
        dev = self.heap.device
        S_M, S_K = (M // self.W, K) if gd == 0 else (M, K // self.W)
        g = torch.Generator(device=dev).manual_seed(seed * 1009 + self.rank)
        a = torch.randn(S_M, S_K, generator=g, device=dev).to(self.dtype)
        gb = torch.Generator(device=dev).manual_seed(seed)  # the same B and bias on every rank
        b = torch.randn(K, N, generator=gb, device=dev).to(self.dtype)
        bias = torch.randn(N, generator=gb, device=dev).to(self.dtype)
        return a, b, bias

    def gathered(self, a, gd):
        from kernels.ag_gemm.baselines import gathered_a

        flat = self.torch.empty((self.W * a.shape[0], a.shape[1]), dtype=a.dtype, device=a.device)
        self.tdist.all_gather_into_tensor(flat, a)
        return gathered_a(flat, self.W, gd).contiguous()

    # methods ----------------------------------------------------------------
    def methods(self, a, b, gd, A_full):
        from kernels.ag_gemm import AgGemmConfig
        from kernels.ag_gemm import baselines as bl
        from kernels.ag_gemm.config import PIPELINED, PLACEHOLDER_FETCH_FRACTION

        heap, ag = self.heap, self.ag
        # a fixed fetcher count (the placeholder rule's), not the measured table's pick, so that
        # "fused" means the same configuration in every run
        fused = AgGemmConfig(variant="fused", fetchers=max(4, self.sms // PLACEHOLDER_FETCH_FRACTION),
                             num_sms=self.sms)
        cfgs = {"fused": fused, "fused_by_k": fused.replace(fetch_order="k"),  # peers' tiles k-group by k-group
                "fused_f32": fused.replace(fetchers=32),  # twice the fetchers (the fetcher sweep's pick along K)
                "copy_engine": AgGemmConfig(variant="copy_engine", num_sms=self.sms),
                "chunked": AgGemmConfig(variant="chunked", num_sms=self.sms),
                # gathered along K, chunked's other schedule: per-shard products summed in fp32
                # (along M there is one schedule: not timed twice)
                "chunked_sum": AgGemmConfig(variant="chunked", k_schedule="sum", num_sms=self.sms),
                "pipelined": AgGemmConfig(**PIPELINED, num_sms=self.sms),
                "sequential": AgGemmConfig(variant="sequential"), "auto": None}
        if self.args.check_only and bl.torch_fused_available():   # PyTorch's op through our launcher
            cfgs["torch"] = AgGemmConfig(variant="torch")
        llm = getattr(self.args, "shape_set", "seed") in overlap.SET_NAMES
        if llm:
            cfgs = {k: v for k, v in cfgs.items() if k in FUSED_LLM + ("sequential", "auto")}
        if gd == 0:
            cfgs.pop("chunked_sum")
        out = {}
        for name, c in cfgs.items():
            ag.prepare(a, b, heap, gather_dim=gd, config=c)
            out[name] = (lambda c=c: ag.all_gather_matmul(a, b, heap, gather_dim=gd, config=c), c)
        a_heap = heap.alloc(a.shape, a.dtype)  # the same call on every rank: the same offset
        a_heap.copy_(a)
        for name in RESIDENT if not llm else ():
            c = cfgs[name.replace("_resident", "")]
            ag.prepare(a_heap, b, heap, gather_dim=gd, config=c)
            out[name] = (lambda c=c: ag.all_gather_matmul(a_heap, b, heap, gather_dim=gd, config=c), c)
        self.tdist.barrier()  # every rank has compiled
        nccl = bl.NcclCublas(a, self.W, gd)
        flat = self.torch.empty((self.W * a.shape[0], a.shape[1]), dtype=a.dtype, device=a.device)
        out["nccl_cublas"] = (lambda: nccl(a, b), {"variant": "nccl"})
        if bl.torch_fused_available():
            tf = bl.TorchFused(self.tdist.group.WORLD.group_name, gd)
            out["torch_fused"] = (lambda: tf(a, b), {"variant": "torch"})
        out["gemm_alone"] = (lambda: bl.gemm_alone(A_full, b), None)
        out["nccl_all_gather"] = (lambda: self.tdist.all_gather_into_tensor(flat, a), None)
        return out

    def over_budget(self) -> bool:
        """Whether --budget-s has passed on any rank (every rank gets the same answer, so they stay in step)."""
        return overlap.budget_passed(self.t0, getattr(self.args, "budget_s", None) or None, self.heap.device)

    def skip(self, what, base):
        self.skipped += 1
        self.emit({"kind": "skipped", "what": what, **base})

    def agree_failed(self, failed: bool) -> bool:
        """Every rank learns whether any failed (then the flags are resynchronized)."""
        if self.agree(failed):
            self.ag.recover(self.heap)
            return True
        return False

    def check(self, name, fn, ref, K, base):
        """C against the fp32 reference, a second call with the same inputs bit-identical, and
        (ours, on GPUs) one replay of a CUDA graph that captured the call bit-identical too; for
        ``auto`` the replay within the tolerance (a capture may get another method: the choice
        serves eager calls and graph replays apart)."""
        torch = self.torch
        row = {"kind": "check", "variant": name, **base}
        crashed = False
        try:
            from kernels.ag_gemm.reference import tolerance

            atol, rtol = tolerance(self.dtype, K)

            def within(c):
                return bool(torch.isfinite(c).all()) and bool(((c.float() - ref).abs() <= atol + rtol * ref.abs()).all())

            ours = _base_variant(name) in OURS   # "fused+bias", "fused_layout_m": ours too
            c1 = fn().clone()
            if ours:   # a call that timed out is reported now: one wait's bound, not one per call made
                self.ag.check(self.heap)
            c2 = fn().clone()
            graph_same, replay_ok = None, True
            if ours:
                self.ag.check(self.heap)
                if self.heap.device.type == "cuda":
                    replayed = overlap.graph_replay_result(fn)
                    graph_same, replay_ok = bool(torch.equal(c1, replayed)), within(replayed)
                    self.ag.check(self.heap)
            err = (c1.float() - ref).abs()
            ok = within(c1) and replay_ok
            row.update(ok=ok, max_abs_err=float(err.max()), atol=atol, rtol=rtol,
                       repeat_identical=bool(torch.equal(c1, c2)), graph_identical=graph_same, error="")
        except Exception as exc:  # noqa: BLE001 - record it, resync, go on
            traceback.print_exc()
            crashed = True
            row.update(ok=False, repeat_identical=False, error=f"{type(exc).__name__}: {exc}"[:800])
        if name not in LIBRARY:
            if self.agree_failed(not row["ok"]) and row["ok"]:
                row.update(ok=False, error="another rank failed this check")
        elif self.agree(not row["ok"]) and row["ok"]:
            # a library baseline: every rank must make the same timing decision (else the world hangs)
            row.update(ok=False, error="another rank's result was outside the tolerance")
        self.emit(row)
        self.accurate[name] = bool(row["ok"])   # the bench rows say it (a library is timed even where it is not)
        # ours are timed only where correct; a library baseline wherever it ran (an inaccurate
        # library result is a finding to report, not a reason to hide its speed)
        return row["ok"] if name not in LIBRARY else not self.agree(crashed)

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (every rank learns the same answer)."""
        return overlap.any_rank(flag, self.heap.device)

    def time(self, fn, mode, base, name, extra=None):
        """One method on its own (the sweeps): every call of it back to back."""
        self.time_all({name: fn}, mode, base, {name: extra or {}}, passes=1)

    def _time_pass(self, fn, mode, name, calls, warmup):
        """(timing, None) for `calls` calls of one method, or (None, (status, error text)) where it
        failed on this rank ("error") or another ("peer_error"): every rank learns whether any did."""
        def measure():
            if mode == "graph":
                t = dist.time_collective(fn, warmup=warmup, iters=max(1, calls // 4), graph=4)
            else:
                t = dist.time_collective(fn, warmup=warmup, iters=calls)
            if name in OURS:
                self.ag.check(self.heap)
            return t

        return overlap.guarded(measure, self.agree_failed)

    def time_all(self, fns, mode, base, extras, passes=PASSES):
        """Time the methods of one case in `passes` passes over all of them, each pass a share of
        the calls and the first method rotating (``overlap.rotating_passes``: timed one block after
        another, the same configuration measured up to 12% slower as the fifth method of a case
        than as the first). A method's time is the median of its passes (each the slowest rank's
        median); each pass of each method is this rank's stage while it runs."""
        names = list(fns)
        calls = self.args.iters if mode == "eager" else 2 * self.args.iters  # graph: 4 calls per replay
        passes = max(1, min(passes, self.args.iters))
        where = f"{mode} {base.get('M')}x{base.get('N')}x{base.get('K')} gather_dim={base.get('gather_dim')}"
        got, errors = overlap.rotating_passes(
            names, lambda name, first: self._time_pass(fns[name], mode, name, max(1, calls // passes),
                                                       5 if first else 2), passes,
            stage=lambda text: self.w.stage(f"{where}: {text}"))
        for row in overlap.pass_rows(names, got, errors, lambda name: {"kind": "bench", "variant": name, "timing": mode,
                                                                       **base, **extras.get(name, {})}):
            self.emit(row)

    # studies ----------------------------------------------------------------
    def run(self):
        torch = self.torch
        modes = [m for m in self.args.modes.split(",") if m]
        llm = getattr(self.args, "shape_set", "seed") in overlap.SET_NAMES
        for si, (M, N, K, extra) in enumerate(self.shapes()):
            for gd in (0, 1):
                base = {"M": M, "N": N, "K": K, "gather_dim": gd, "dtype": "bfloat16", **extra}
                case = f"{M}x{N}x{K} gather_dim={gd}"
                self.w.stage(f"budget {case}")
                if self.over_budget():
                    self.skip("case", base)
                    continue
                self.w.stage(f"inputs {case} (NCCL gathers the reference's A)")
                a, b, bias = self.inputs(M, N, K, gd, seed=si * 2 + gd)
                A_full = self.gathered(a, gd)
                ref = A_full.float() @ b.float()
                self.w.stage(f"methods {case} (compiled and prepared on every rank)")
                methods = self.methods(a, b, gd, A_full)
                ok = {}
                for name, (fn, cfg) in methods.items():
                    if name == "nccl_all_gather":
                        ok[name] = True
                        continue
                    self.w.stage(f"check {name} {case}")
                    ok[name] = self.check(name, fn, ref, K, base)
                if si == 1 and not llm:  # bias and the m-contiguous layout, once per convention
                    from kernels.ag_gemm import AgGemmConfig

                    for label, cfg, bs in (
                            ("fused+bias", AgGemmConfig(fetchers=16, num_sms=self.sms), bias),
                            ("fused_layout_m", AgGemmConfig(fetchers=16, layout="m", num_sms=self.sms), None),
                            ("copy_engine+bias", AgGemmConfig(variant="copy_engine", num_sms=self.sms), bias)):
                        self.w.stage(f"check {label} {case}")
                        self.ag.prepare(a, b, self.heap, gather_dim=gd, bias=bs, config=cfg)
                        self.tdist.barrier()
                        r = ref + bs.float() if bs is not None else ref
                        self.check(label, lambda c=cfg, bs=bs: self.ag.all_gather_matmul(
                            a, b, self.heap, gather_dim=gd, bias=bs, config=c), r, K, base)
                del ref
                if self.args.check_only:
                    self.heap.reset()
                    continue
                self.w.stage(f"auto config {case}")
                for mode in modes:
                    # the choice for the mode timed (eager calls and graph replays may differ)
                    auto_plan = self.ag.launch.get_plan(a, b, self.heap, gather_dim=gd, mode=mode)
                    auto_info = {"auto_variant": auto_plan.cfg.variant, "auto_source": self.ag.auto_source(self.W),
                                 "auto_fallback": auto_plan.cfg.variant in self.ag.config.FALLBACKS,
                                 "auto_config": json.dumps(auto_plan.cfg.__dict__)}
                    live = {name: fn for name, (fn, cfg) in methods.items() if ok.get(name)}
                    extras = {name: {**(auto_info if name == "auto" else {}),
                                     **({"config": _config_json(cfg)} if cfg is not None else {}),
                                     "within_tolerance": self.accurate.get(name)}
                              for name, (fn, cfg) in methods.items()}
                    self.w.stage(f"{mode} {case}")
                    self.time_all(live, mode, base, extras)
                if (M, N, K) in TRACE_SHAPES and not self.args.no_sweeps and not llm:
                    self.sweeps(a, b, gd, base, full=(M, N, K) == SWEEP_SHAPE)
                if (M, N, K) in TRACE_SHAPES and gd == 0 and not llm:
                    for order in ("m", "k"):  # the peers' tiles row tile by row tile, then k-group by k-group
                        self.trace(a, b, gd, base, order)
                del methods, A_full
                self.heap.reset()
                torch.cuda.empty_cache()

    def sweeps(self, a, b, gd, base, full=True):
        from kernels.ag_gemm import AgGemmConfig

        # how GEMM programs wait (both fetch orders): at M 1024 each has about one tile, so its
        # remote K loop runs while the peer's k-groups arrive
        points = [("wait_growth", dict(fetchers=16, wait_growth=g, fetch_order=o)) for o in ("m", "k")
                  for g in WAIT_GROWTH]
        # who copies our shard into the heap before the peers may fetch it: every program, or the fetchers
        points += [("publish_all", dict(fetchers=16, publish_all=p, fetch_order=o)) for o in ("m", "k")
                   for p in (True, False)]
        if full:
            points += self._full_sweep()
        self._time_sweep(a, b, gd, base, points)

    @staticmethod
    def _full_sweep():
        points = [("fetchers", dict(fetchers=f)) for f in FETCHERS]
        points += [("layout", dict(fetchers=16, layout=lay)) for lay in ("k", "m")]
        points += [("k_per_flag", dict(fetchers=16, k_per_flag=k)) for k in K_PER_FLAG]
        points += [("staged_flag", dict(fetchers=16, staged_flag=False))]  # poll every k-group throughout
        points += [("block", dict(fetchers=16, **kw)) for kw in (dict(block_n=128), dict(block_n=128, num_stages=4),
                                                                 dict(num_stages=4), dict(block_k=32, num_stages=5))]
        points += [("tma", dict(fetchers=16, tma=False))]  # pointer loads in the GEMM programs
        points += [("claim", dict(fetchers=16, claim_tiles=False))]  # a static tile schedule, fetchers only fetch
        return points

    def _time_sweep(self, a, b, gd, base, points):
        from kernels.ag_gemm import AgGemmConfig

        for study, kw in points:
            if self.over_budget():
                self.skip(f"sweep {study} {kw}", base)
                continue
            cfg = AgGemmConfig(num_sms=self.sms, **kw)
            self.w.stage(f"sweep {study} {kw}")
            self.ag.prepare(a, b, self.heap, gather_dim=gd, config=cfg)
            self.tdist.barrier()
            fn = (lambda c=cfg: self.ag.all_gather_matmul(a, b, self.heap, gather_dim=gd, config=c))
            self.time(fn, "graph", dict(base, kind="sweep"), "fused",
                      {"study": study, "config": json.dumps(cfg.__dict__), **kw})

    def trace(self, a, b, gd, base, fetch_order="m"):
        from kernels.ag_gemm import AgGemmConfig
        from kernels.ag_gemm.launch import get_plan
        from kernels.ag_gemm.trace import frame

        self.w.stage(f"trace fetch_order={fetch_order}")
        cfg = AgGemmConfig(fetchers=16, num_sms=self.sms, fetch_order=fetch_order)
        self.ag.prepare(a, b, self.heap, gather_dim=gd, config=cfg, trace=True)
        self.tdist.barrier()
        for _ in range(3):  # warm: the last call is the one kept
            _, raw = self.ag.all_gather_matmul(a, b, self.heap, gather_dim=gd, config=cfg, trace=True)
        self.ag.check(self.heap)
        plan = get_plan(a, b, self.heap, gather_dim=gd, config=cfg, trace=True)
        df = frame(raw, rank=self.rank, fetchers=plan.kw["FETCHERS"])
        for rec in df.to_dict("records"):
            rec["event"] = rec.pop("kind")  # publish / fetch / wait / compute ("kind" names the row type)
            self.emit({**base, **rec, "kind": "trace", "fetch_order": fetch_order})


def _config_json(cfg) -> str:
    """A method's configuration for the tables: a config's fields, or the dict given."""
    return json.dumps(cfg if isinstance(cfg, dict) else cfg.__dict__)


def worker(args):
    import torch.distributed as tdist

    with dist.worker() as w:
        r = Rank(w, args)
        try:
            r.run()
        finally:
            w.stage("done")
        if w.run_dir is None:  # plain torchrun: rank 0 writes the tables
            w.stage("tables (rank 0 gathers every rank's rows)")
            everyone = [None] * tdist.get_world_size()
            tdist.all_gather_object(everyone, r.rows)
            if tdist.get_rank() == 0:
                rows = [row for part in everyone for row in part]
                finish(rows, Path(args.out), tdist.get_world_size(), args)


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------
CASE_KEYS = ["world_size", "gather_dim", "M", "N", "K"]


def summarize(bench):
    """Per (world, gather_dim, shape, timing): each method's ms, ours vs NCCL+cuBLAS and vs GEMM alone."""
    import pandas as pd

    from kernels.ag_gemm.metrics import tflops

    ok = bench[(bench["status"] == "ok") & (bench["rank"] == 0)]
    rows = []
    for case, ms, g in overlap.per_case(ok, CASE_KEYS):
        M, N, K = case["M"], case["N"], case["K"]
        row = {**case, **{f"{v}_ms": t for v, t in ms.items()}}
        seq = ms.get("nccl_cublas")
        best = overlap.best_of(ms, FUSED)
        if best:
            row["best_fused"] = best
            row["best_fused_ms"] = ms[best]
        for v in FUSED + ("auto", "torch_fused", "sequential", "nccl_cublas") + RESIDENT:
            if v in ms and seq:
                row[f"{v}_speedup_vs_nccl_cublas"] = seq / ms[v]
            if v in ms and "gemm_alone" in ms:
                row[f"{v}_frac_of_gemm_alone"] = ms[v] / ms["gemm_alone"]
            if v in ms:
                row[f"{v}_tflops"] = tflops(M, N, K, ms[v])
                # comm hidden = (T_gemm + T_comm - T) / T_comm: the GEMM alone, the NCCL all-gather alone
                row[f"{v}_comm_hidden"] = overlap.comm_hidden(ms.get("gemm_alone"), ms.get("nccl_all_gather"), ms[v])
        row["winner"] = overlap.best_of(ms, FUSED + ("torch_fused", "sequential", "nccl_cublas"))
        libs = {v: ms[v] for v in ("nccl_cublas", "torch_fused") if v in ms}
        if best and libs:   # the bar: the best of ours against the best library
            row["best_fused_vs_best_library"] = min(libs.values()) / row["best_fused_ms"]
            row["best_fused_comm_hidden"] = overlap.comm_hidden(ms.get("gemm_alone"), ms.get("nccl_all_gather"),
                                                                row["best_fused_ms"])
        for f in ("layer", "split"):
            if f in g:
                row[f] = g[f].iloc[0]
        if "within_tolerance" in g:   # a library's result outside the tolerance is timed all the same: said here
            for v in ("torch_fused", "nccl_cublas"):
                if v in ms:
                    row[f"{v}_within_tolerance"] = g[g["variant"] == v]["within_tolerance"].iloc[0]
        auto = g[g["variant"] == "auto"]
        if len(auto):
            row["auto_variant"] = auto.iloc[0].get("auto_variant")
            row["auto_fallback"] = auto.iloc[0].get("auto_fallback")
            row["auto_source"] = auto.iloc[0].get("auto_source")
        rows.append(row)
    return pd.DataFrame(rows)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'MxNxK,...' -> [(M, N, K), ...]; ValueError naming the bad item."""
    shapes = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {item!r} is not MxNxK with positive integers (e.g. 2048x3584x8192)")
        shapes.append(tuple(int(p) for p in parts))
    if not shapes:
        raise ValueError("--shapes: no shape given (e.g. --shapes 2048x3584x8192,8192x3584x8192)")
    return shapes


def fit_auto_table(bench) -> dict:
    """Per measured problem: the fastest way in eager calls (as users call it): a fused variant,
    or, where neither fused variant wins, the faster of our sequential path and NCCL + cuBLAS
    (variant "nccl", the very code the baseline times)."""
    from kernels.ag_gemm.config import FALLBACKS

    entries = []
    ok = bench[(bench["status"] == "ok") & (bench["rank"] == 0) & (bench["timing"] == "eager")]
    for (W, gd, M, N, K), g in ok.groupby(["world_size", "gather_dim", "M", "N", "K"]):
        ours = g[g["variant"].isin(CHOICES)]
        if not len(ours):
            continue
        best = ours.loc[ours["ms"].idxmin()]
        if best["variant"] in LIBRARY_VARIANT:
            cfg = dict(LIBRARY_VARIANT[best["variant"]])
        else:
            cfg = json.loads(best["config"]) if isinstance(best.get("config"), str) else {"variant": best["variant"]}
        cfg = {k: v for k, v in cfg.items() if k not in ("skip_rank",)}
        entries.append({"world_size": int(W), "gather_dim": int(gd), "M": int(M), "N": int(N), "K": int(K),
                        "config": cfg, "ms": float(best["ms"]),
                        "fallback": cfg["variant"] in FALLBACKS})
    return {"source": "experiments/run_ag_gemm.py (eager calls, rank 0, median)", "entries": entries}


def model_features(case: dict) -> dict:
    """A case's features for the choice model (``kernels.ag_gemm.config.model_features``)."""
    from kernels.ag_gemm.config import model_features as features

    return features(int(case["M"]), int(case["N"]), int(case["K"]), int(case["world_size"]))


def never_off_table(match: dict) -> dict:
    """{method: why} the choice model never takes in a group (``kernels.ag_gemm.config.NEVER_OFF_TABLE``)."""
    from kernels.ag_gemm.config import NEVER_OFF_TABLE

    never = NEVER_OFF_TABLE.get(int(match.get("gather_dim", 0)), {})
    variants = {**{m: m for m in CHOICES}, **{m: cfg["variant"] for m, cfg in LIBRARY_VARIANT.items()}}
    return {m: never[v] for m, v in variants.items() if v in never}


AG_GEMM = overlap.Study(family="ag_gemm", name="all_gather_matmul", script="experiments/run_ag_gemm.py",
                        keys=tuple(CASE_KEYS), match_keys=("world_size", "gather_dim"), choices=CHOICES,
                        libraries=("nccl_cublas", "torch_fused"), gemm="gemm_alone", comm="nccl_all_gather",
                        fused=FUSED, features=model_features, never=never_off_table)


def fit_and_hold_out(bench, out: Path, model_splits: tuple = ("fit",)) -> list[str]:
    """The LLM shape set's variant choice (``overlap.fit_and_hold_out``): fitted on the fit half's
    calls (the fastest of ours, our sequential path and NCCL + cuBLAS per shape: auto_table.json,
    which kernels/ag_gemm/config.py reads), then scored on the held-out half (held_out.csv: each
    held-out shape's choice by the nearest fitted shape, against the best of ours and of the
    libraries, eager and graph-replayed, with comm hidden); variant_choice.csv lists both."""
    import pandas as pd

    from kernels.ag_gemm.config import FALLBACKS

    configs = {}
    for v, cfg in zip(bench["variant"], bench.get("config", pd.Series([None] * len(bench)))):
        if isinstance(cfg, str) and v not in configs:
            configs[v] = json.loads(cfg)
    configs.update(LIBRARY_VARIANT)

    def tidy(e):
        e["config"] = {k: v for k, v in e["config"].items() if k not in ("skip_rank", "max_spins")}
        e["fallback"] = e["config"].get("variant") in FALLBACKS

    return overlap.fit_and_hold_out(AG_GEMM, bench, out, configs, tidy=tidy,
                                    source="experiments/run_ag_gemm.py --shape-set: fit half, eager",
                                    how="eager calls, the slowest rank's median over rotating passes, fit half",
                                    model_splits=model_splits)


def merge_auto_table(path: Path, fitted: dict) -> dict:
    """``fitted`` with the entries of other world sizes that ``path`` already holds (a run at
    world size 4 adds to the table that a run at 2 wrote, and replaces only its own)."""
    from kernels.ag_gemm.config import load_table

    if load_table(path) is None:  # absent (a malformed table is refused, naming the file)
        return fitted
    worlds = {e["world_size"] for e in fitted["entries"]}
    kept = [e for e in json.loads(path.read_bytes())["entries"] if int(e["world_size"]) not in worlds]
    return {**fitted, "entries": kept + fitted["entries"]}


def finish(rows, out: Path, W: int, args) -> int:
    import pandas as pd

    from workbench import provenance

    out.mkdir(parents=True, exist_ok=True)
    prov = provenance.flat(provenance.collect(world_size=W))
    for r in rows:
        r.update({k: v for k, v in prov.items() if k != "world_size"})
        r["command"] = " ".join(sys.argv)
    df = pd.DataFrame(rows)
    written = []
    for kind, name in (("check", "checks.csv"), ("bench", "bench.csv"), ("sweep", "sweeps.csv"),
                       ("trace", "trace.csv"), ("skipped", "skipped.csv")):
        part = df[df["kind"] == kind].dropna(axis=1, how="all") if "kind" in df else pd.DataFrame()
        if len(part):
            part.to_csv(out / name, index=False)
            written.append(name)
    pd.set_option("display.width", 250)
    checks = df[df["kind"] == "check"] if "kind" in df else pd.DataFrame()
    bad = checks.iloc[:0]
    if len(checks):
        missed = checks[~checks["ok"].astype(bool)]
        print(f"checks: {len(checks) - len(missed)}/{len(checks)} within bf16 tolerance of the fp32 reference")
        library = missed[missed["variant"].isin(LIBRARY)]
        if len(library):  # the libraries' results are reported, and timed; only ours fail the run
            print("library baselines outside the tolerance (timed all the same):")
            print(library[["rank", "variant", "M", "N", "K", "gather_dim", "max_abs_err", "atol", "error"]]
                  .to_string(index=False))
        bad = missed[~missed.index.isin(library.index)]
        if len(bad):
            print(bad[["rank", "variant", "M", "N", "K", "gather_dim", "error"]].to_string(index=False))
    skipped = df[(df["kind"] == "skipped") & (df["rank"] == 0)] if "kind" in df else pd.DataFrame()
    if len(skipped):
        print(f"time budget (--budget-s {getattr(args, 'budget_s', None)}) ran out: {len(skipped)} cases / sweep "
              "points not measured (skipped.csv)")
    bench = df[df["kind"] == "bench"] if "kind" in df else pd.DataFrame()
    if len(bench):
        summary = summarize(bench)
        for c, v in prov.items():
            summary[c] = v
        summary.to_csv(out / "summary.csv", index=False)
        written.append("summary.csv")
        if getattr(args, "shape_set", "seed") in overlap.SET_NAMES:
            written += fit_and_hold_out(bench, out)
        elif not getattr(args, "shapes", None):  # a run on other shapes scores the table, never refits it
            table = Path(getattr(args, "auto_table", None) or out / "auto_table.json")
            table.write_text(json.dumps(merge_auto_table(table, fit_auto_table(bench)), indent=1))
            written.append(str(table) if table.parent != out else table.name)
        cols = ["timing", "world_size", "gather_dim", "M", "N", "K", "nccl_cublas_ms", "sequential_ms", "fused_ms",
                "copy_engine_ms", "chunked_ms", "torch_fused_ms", "auto_ms", "gemm_alone_ms",
                "fused_speedup_vs_nccl_cublas", "copy_engine_speedup_vs_nccl_cublas", "chunked_speedup_vs_nccl_cublas",
                "auto_speedup_vs_nccl_cublas", "auto_variant", "winner"]
        print(summary[[c for c in cols if c in summary]].round(3).to_string(index=False))
    print("wrote", ", ".join(written), "to", out)
    if len(bad):
        print(f"FAILED: {len(bad)} check(s) outside the tolerance", flush=True)
    return 1 if len(bad) else 0


def parent(args) -> int:
    import torch

    rows = []
    failed_worlds = []
    sizes = [int(s) for s in args.world_sizes.split(",") if s.strip()]
    for W in sizes:
        if torch.cuda.device_count() < W:
            print(f"world size {W}: skipped, this machine has {torch.cuda.device_count()} GPU(s)", flush=True)
            continue
        cmd = ["--worker", "--modes", args.modes, "--iters", str(args.iters)]
        cmd += ["--quick"] * args.quick + ["--check-only"] * args.check_only + ["--no-sweeps"] * args.no_sweeps
        cmd += ["--budget-s", str(args.budget_s)] if args.budget_s else []
        cmd += ["--shapes", args.shapes] if args.shapes else []
        cmd += ["--shape-set", args.shape_set] if args.shape_set != "seed" else []
        cmd += ["--random-shapes", str(args.random_shapes), "--random-seed", str(args.random_seed)] * bool(
            args.random_shapes)
        t0 = time.time()
        print(f"world size {W}: launching ...", flush=True)
        part, err = dist.launch_rows(Path(__file__), W, cmd, timeout_s=args.timeout)
        if err:
            print(err, flush=True)
            failed_worlds.append(W)
        print(f"world size {W}: {len(part)} rows in {time.time() - t0:.0f} s", flush=True)
        for r in part:
            r["launch_error"] = err[:500]
        rows += part
    if not rows:
        print("no rows")
        return 1
    rc = finish(rows, Path(args.out), max(sizes), args)
    if failed_worlds:  # a crash or a hang past --timeout fails the run; the tables above keep what was measured
        print(f"FAILED: world size(s) {', '.join(map(str, failed_worlds))} did not finish (see above)", flush=True)
        return 1
    return rc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "results" / "ag_gemm"), help="folder for the CSVs")
    ap.add_argument("--world-sizes", default="2", help="without torchrun: world sizes to launch (default 2)")
    ap.add_argument("--modes", default="eager,graph", help="eager and/or graph (CUDA-graph replays)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per point (graph: half as many replays)")
    ap.add_argument("--quick", action="store_true", help="the first two shapes only")
    ap.add_argument("--shape-set", default="seed", choices=("seed",) + overlap.SET_NAMES,
                    help="seed: the seed's shapes (default); llm / llm-reduced: the LLM tensor-parallel set of "
                         "experiments/overlap.py, the variants by name and every baseline, a variant choice fitted "
                         "on its fit half and scored on its held-out half (auto_table.json, held_out.csv, "
                         "variant_choice.csv); no sweeps or traces")
    ap.add_argument("--shapes", default=None,
                    help="other gathered shapes, 'MxNxK,MxNxK,...' (M and K multiples of the world size): scores "
                         "the auto-config on problems it was not fitted on; writes no auto-config table")
    ap.add_argument("--random-shapes", type=int, default=0,
                    help="with --shape-set: this many shapes besides, drawn at run time (M uniform in [128, 16384], "
                         "N and K multiples of 128 in [1024, 16384]; split 'random', scored, never fitted)")
    ap.add_argument("--random-seed", type=int, default=None,
                    help="their seed (default: drawn at run time and printed; under plain torchrun: required)")
    ap.add_argument("--check-only", action="store_true", help="only the correctness checks")
    ap.add_argument("--no-sweeps", action="store_true", help="skip the fetcher/layout/flag-group sweeps")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no (shape, convention) case or sweep point after this many seconds in the world "
                         "(the rest are listed in skipped.csv); default: no limit")
    ap.add_argument("--auto-table", default=None,
                    help="the auto-config table to write (default: OUT/auto_table.json); entries of world sizes "
                         "this run did not measure are kept, so runs at 2 and 4 ranks can share "
                         "results/ag_gemm/auto_table.json")
    ap.add_argument("--timeout", type=float, default=570,
                    help="seconds per world before it is killed (a hang ends that world; the run then exits 1)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.shapes:
        try:
            shapes = parse_shapes(args.shapes)
            sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
        except ValueError as exc:
            ap.error(str(exc))
        odd = [f"{M}x{N}x{K}" for M, N, K in shapes for W in sizes if M % W or K % W]
        if odd:
            ap.error(f"--shapes: M and K must be multiples of every world size ({args.world_sizes}): {odd}")
    args.random_seed = overlap.random_seed(ap, args, worker=args.worker or "LOCAL_RANK" in os.environ)
    if args.worker or "LOCAL_RANK" in os.environ:  # under workbench.dist.launch or plain torchrun
        worker(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
