"""Fused GEMM + all-scatter on a GPU node: correctness first, then every study of
experiments/gemm_scatter.yaml, eager and CUDA-graph replayed, in one command
per world size (one process per GPU, NVLink multicast off):

    torchrun --nproc-per-node 2 experiments/run_gemm_scatter.py --out results/gemm_scatter/
    torchrun --nproc-per-node 1 experiments/run_gemm_scatter.py --out results/gemm_scatter/
    torchrun --nproc-per-node 4 experiments/run_gemm_scatter.py --out results/gemm_scatter/   # 4 and 8 GPUs
    torchrun --nproc-per-node 8 experiments/run_gemm_scatter.py --out results/gemm_scatter/

or without torchrun, one world per size through workbench.dist.launch (what the
notebook does; ``--timeout`` kills a world that runs longer, e.g. a hang):

    python experiments/run_gemm_scatter.py --world-sizes 2 --out results/gemm_scatter/
    python experiments/run_gemm_scatter.py --world-sizes 1,2 --budget-s 240 --out results/gemm_scatter/

Writes, for world size W, under --out: ``checks_wW.csv`` (every variant and
baseline against an fp32 torch product on odd and seed shapes, on every rank),
``times_wW.csv`` (one row per timed point: study, shape, variant, config,
timing mode, median and quartiles of the slowest rank, TFLOP/s),
``summary_wW.csv`` (per shape and mode: the fused kernel against cuBLAS + NCCL
and against the GEMM alone) and ``info_wW.csv``; every row carries provenance
(git sha, versions, device, world size, knobs, the command). A point whose
kernel fails is recorded with its error and the world resynchronizes; when the
time budget (--budget-s, counted from the start of each world) runs out, the
remaining points are listed as skipped. The exit status is 1 when a check
misses its tolerance or (without torchrun) a world failed or ran past --timeout.
The checks cover every variant (fused, senders, sequential, nccl) and, on GPUs,
a repeated call and one CUDA-graph replay of ours, which must give the same bits.

``--shape-set llm`` / ``llm-reduced`` runs the overlap study instead of the spec's:
the LLM tensor-parallel set of ``experiments/overlap.py``, per shape our variants by
name (fused, senders, sequential, auto), cuBLAS + NCCL (buffers made once), cuBLAS
alone on this rank's block and NCCL's all-gather of it alone, eager and graph-replayed
in rotating passes; ``summary_wW.csv`` with comm hidden = (T_gemm + T_comm - T) / T_comm
and each variant's time over max(GEMM alone, all-gather alone); the variant choice
fitted on the set's fit half (``auto_table.json``, which ``kernels/gemm_scatter/config.py``
reads from ``results/gemm_scatter/``) and scored on its held-out half
(``held_out_wW.csv``, ``variant_choice_wW.csv``). ``experiments/run_overlap.py`` runs the
reduced set at 2 ranks with the tests.

Each rank marks what it is doing as its stage (the heap, each check, each point's variant
and timing mode, each timing pass of the overlap study), so a world that hangs past
``--timeout`` is named by the step it hung in. What the two overlap studies do alike (timing
passes, the fit / held-out split, the choice tables) is ``experiments/overlap.py``'s.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

# NVLink multicast off before anything can initialize NCCL or symmetric memory.
os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "experiments"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import overlap  # noqa: E402  (experiments/overlap.py: the overlap studies' driver)

SPEC = REPO / "experiments" / "gemm_scatter.yaml"
BASELINES = ("cublas+nccl", "triton+all_gather", "cublas_alone", "triton_alone")
# --shape-set llm / llm-reduced: our variants by name, the libraries, the GEMM and the all-gather alone
OVERLAP_OURS = ("fused", "senders", "sequential", "auto")
OVERLAP_LIBRARY = ("cublas+nccl", "cublas_alone", "nccl_all_gather")
CHOICES = ("fused", "senders", "sequential", "cublas+nccl")   # the variant choice picks from these
PASSES = 4
# (M, N, K): odd sizes (M=1, M not a multiple of any tile, N / W not a multiple of BLOCK_N
# at W=2 and 4), then two seed shapes
CHECK_SHAPES = [(1, 4096, 14336), (77, 1000, 264), (200, 3072, 520), (256, 4096, 4096), (1024, 8192, 4096)]


# --------------------------------------------------------------------------
# The spec, expanded to points (no GPU needed: tests count them)
# --------------------------------------------------------------------------
def _shapes(shape_set: dict, world_size: int) -> list[tuple[int, int, int]]:
    out = []
    for M in shape_set["M"]:
        if "NK" in shape_set:
            out += [(M, N, K) for N, K in shape_set["NK"]]
        else:
            out += [(M, world_size * n, K) for n, K in shape_set["n_local_K"]]
    return out


def _configs(study: dict) -> list[dict | None]:
    if "configs" in study:
        return list(study["configs"])
    grid = study.get("grid") or {}
    keys = list(grid)
    out = []
    for values in itertools.product(*(grid[k] for k in keys)):
        cfg = dict(study.get("fixed") or {})
        for k, v in zip(keys, values):
            if k == "block_mn":
                cfg["block_m"], cfg["block_n"] = v
            else:
                cfg[k] = v
        limit = study.get("skip_if_acc_regs_over")
        if limit and cfg["block_m"] * cfg["block_n"] / (32 * cfg["num_warps"]) > limit:
            continue
        out.append(cfg)
    return out


def load_plan(path: Path = SPEC, world_size: int = 2, quick: bool = False, studies=None) -> dict:
    """The spec as a list of points (study, M, N, K, config dict or None, hints) and its settings."""
    import yaml

    spec = yaml.safe_load(Path(path).read_text())
    sets = dict(spec["shape_sets"])
    if quick:
        sets.update((spec.get("quick") or {}).get("shape_sets") or {})
    points = []
    for study in spec["studies"]:
        if studies and study["study"] not in studies:
            continue
        for M, N, K in _shapes(sets[study["shapes"]], world_size):
            if N % world_size:
                continue
            for cfg in _configs(study):
                hints = True
                if cfg is not None and "hints" in cfg:
                    cfg = dict(cfg)
                    hints = cfg.pop("hints")
                points.append({"study": study["study"], "M": M, "N": N, "K": K, "config": cfg, "hints": hints,
                               "baselines": bool(study.get("baselines"))})
    return {"points": points, "dtype": spec.get("dtype", "bfloat16"), "seed": spec.get("seed", 0),
            "modes": spec.get("modes", ["eager", "graph"]), "baselines": spec.get("baselines", list(BASELINES)),
            "check_shapes": [tuple(s) for s in spec.get("check_shapes", CHECK_SHAPES)]}


# --------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------
def operands(M, N, K, W, rank, dtype, seed, device):
    """A (same on every rank) and every rank's block of B, from seeds alone, scaled so C ~ N(0, 1)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + M * 7 + N * 13 + K)
    a = torch.randn((M, K), generator=g, device=device).to(dtype)
    bs = [(torch.randn((K, N // W), generator=g, device=device) / math.sqrt(K)).to(dtype) for _ in range(W)]
    return a, bs


class Runner:
    """One rank's share of the run. ``heap``: a symmetric heap to use instead of
    making one (a simulated world's heap lets the tests drive every code path on a
    CPU, with a one-rank gloo group already initialized)."""

    def __init__(self, args, heap=None, stage=None):
        import torch
        import torch.distributed as tdist

        from kernels.comm import sweep as commsweep

        self.torch, self.tdist, self.args = torch, tdist, args
        if not tdist.is_initialized():
            tdist.init_process_group("nccl")
        self.rank, self.W = tdist.get_rank(), tdist.get_world_size()
        spec = load_plan(Path(args.spec), self.W, args.quick,
                         [s for s in args.studies.split(",") if s] if args.studies else None)
        self.plan = spec
        self.dtype = getattr(torch, self.plan["dtype"])
        self.stage = stage or (lambda name: None)  # what this rank is doing (a launched world's heartbeat)
        if heap is None:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", self.rank)))
            self.stage("symmetric heap")
            heap = commsweep.process_heap(args.heap_mib << 20)
        self.heap, self.device = heap, heap.device
        self.cuda = self.device.type == "cuda"
        self.t0 = time.time()
        self.rows, self.skipped = [], 0

    # ---- variants -------------------------------------------------------
    def fn(self, variant, a, b, config=None, hints=True):
        from kernels.gemm_scatter import gemm_all_scatter, gemm_alone, gemm_then_all_gather

        heap = self.heap
        if variant == "fused":
            return lambda: gemm_all_scatter(a, b, heap, config=config, hints=hints)
        if variant == "cublas+nccl":
            return lambda: gemm_then_all_gather(a, b, heap, gemm="cublas", gather="nccl")
        if variant == "triton+all_gather":
            return lambda: gemm_then_all_gather(a, b, heap, gemm="triton", gather="triton")
        if variant in ("cublas_alone", "triton_alone"):
            return lambda: gemm_alone(a, b, gemm=variant.split("_")[0])
        raise ValueError(f"unknown variant {variant!r}")

    def agree(self, failed: int) -> bool:
        """Whether any rank failed (every rank learns the same answer)."""
        return overlap.any_rank(failed, self.device)

    def over_budget(self) -> bool:
        return overlap.budget_passed(self.t0, self.args.budget_s, self.device)

    def agree_failed(self, failed: bool) -> bool:
        """Whether any rank failed; then every rank recovers (flags resynchronized)."""
        if self.agree(int(failed)):
            from kernels.gemm_scatter import recover

            recover(self.heap)
            return True
        return False

    # ---- correctness ----------------------------------------------------
    def checks(self):
        from kernels.gemm_scatter import reference

        torch = self.torch
        rows = []
        # (row name, fn variant, config, hints): our kernel's configurations and variants, then the libraries
        variants = [("fused", "fused", None, True), ("fused", "fused", None, False),
                    ("fused", "fused", {"from_registers": False}, True),
                    ("fused", "fused", {"tma_loads": False, "block_m": 64, "block_n": 64, "num_warps": 4}, True),
                    ("senders", "fused", {"variant": "senders"}, True),
                    ("sequential", "fused", {"variant": "sequential"}, True),
                    ("nccl", "fused", {"variant": "nccl"}, True),
                    ("cublas+nccl", "cublas+nccl", None, True), ("triton+all_gather", "triton+all_gather", None, True)]
        for M, N, K in self.plan["check_shapes"]:
            if N % self.W:
                continue
            self.stage(f"check {M}x{N}x{K}")
            a, bs = operands(M, N, K, self.W, self.rank, self.dtype, 99, self.device)
            ref = reference(a, bs)
            for name, variant, cfg, hints in variants:
                self.stage(f"check {name} {cfg or ''} hints={hints} {M}x{N}x{K}")
                row = {"kind": "check", "variant": name, "config": json.dumps(cfg), "hints": hints, "M": M,
                       "N": N, "K": K, "rank": self.rank}
                try:
                    from kernels.gemm_scatter import out_buffer

                    if variant == "fused":
                        out_buffer(self.heap, M, N, self.dtype).view(torch.uint8).fill_(0xFF)  # NaN poison
                    self.heap.barrier()
                    fn = self.fn(variant, a, bs[self.rank], cfg, hints)
                    got = fn().float().clone()
                    from kernels.gemm_scatter.launch import check_gemm_all_scatter

                    check_gemm_all_scatter(self.heap)
                    self.heap.barrier()  # nobody refills C while a peer still reads it
                    if variant == "fused" and self.cuda:   # ours: one CUDA-graph replay gives the same bits
                        again = fn().float().clone()
                        self.heap.barrier()
                        replayed = overlap.graph_replay_result(fn).float()
                        check_gemm_all_scatter(self.heap)
                        self.heap.barrier()
                        row.update(repeat_identical=bool(torch.equal(got, again)),
                                   graph_identical=bool(torch.equal(got, replayed)))
                    err = (got - ref).abs()
                    tol = 3e-2 + 2e-2 * ref.abs()
                    bad = int((~(err <= tol)).sum())  # NaN counts as bad
                    row.update(ok=bad == 0, bad_elements=bad, max_abs_err=float(err.nan_to_num(1e30).max()),
                               error="")
                except Exception as exc:  # noqa: BLE001 - recorded; the world resyncs
                    row.update(ok=False, bad_elements=-1, error=f"{type(exc).__name__}: {exc}"[:500])
                    traceback.print_exc()
                self.agree_failed(not row["ok"] and row["bad_elements"] == -1)  # a crash anywhere: every rank recovers
                rows.append(row)
            self.heap.reset()
        allrows = [None] * self.W
        self.tdist.all_gather_object(allrows, rows)
        return [r for part in allrows for r in part]

    # ---- timing ---------------------------------------------------------
    def time_point(self, fn, mode, flop, passes=1):
        """The slowest rank's median per call (``passes`` > 1: one of that many passes, a share of
        the calls each)."""
        from workbench import dist

        per = max(1, min(20, int(2e12 / max(flop, 1))))  # calls per graph: ~2 TFLOP per replay at most
        iters = max(5, min(30, int(4e13 / max(flop, 1))) // passes)
        if mode == "graph":
            return dist.time_collective(fn, warmup=3, iters=max(5, iters // per), graph=per)
        return dist.time_collective(fn, warmup=5, iters=iters)

    def measure(self, study, M, N, K, variant, config=None, hints=True):
        from kernels.gemm_scatter.config import as_config
        from kernels.gemm_scatter.launch import plan_for

        rows = []
        a, bs = self.inputs(M, N, K)
        base = {"kind": "time", "study": study, "variant": variant, "M": M, "N": N, "K": K, "n_local": N // self.W,
                "world_size": self.W, "dtype": self.plan["dtype"], "hints": hints if variant == "fused" else None}
        if variant == "fused":
            try:
                p = plan_for(a, bs[self.rank], self.heap, config, hints=hints)
                cfg = p.config
                base.update(config=cfg.label(), config_given=json.dumps(config), grid=p.grid,
                            tma_loads=p.meta["TMA_LOADS"], hints_in_force=p.hints,
                            tiles=math.ceil(M / cfg.block_m) * math.ceil((N // self.W) / cfg.block_n),
                            **{k: v for k, v in cfg.as_params().items() if k != "tma_loads"})
            except ValueError as exc:  # a config the launcher refuses (e.g. too much shared memory)
                cfg = as_config(config)
                return [dict(base, timing=m, status="invalid", error=str(exc)[:300],
                             config=cfg.label() if cfg else "") for m in self.plan["modes"]]
        flop = 2 * M * N * K
        for mode in self.plan["modes"]:
            self.stage(f"{study} {variant} {config or ''} {mode} {M}x{N}x{K}")
            row = dict(base, timing=mode)
            failed = 0
            try:
                t = self.time_point(self.fn(variant, a, bs[self.rank], config, hints), mode, flop / self.W)
                if variant == "fused":
                    from kernels.gemm_scatter.launch import check_gemm_all_scatter

                    check_gemm_all_scatter(self.heap)
                row.update(ms=t["ms"], q25_ms=t["q25_ms"], q75_ms=t["q75_ms"], loop_ms=t["loop_ms"],
                           slowest_rank=t["slowest_rank"], iters=t["iters"], graph_calls=t["graph"],
                           tflops=flop / (t["ms"] * 1e9), tflops_per_gpu=flop / self.W / (t["ms"] * 1e9),
                           status="ok", error="")
            except Exception as exc:  # noqa: BLE001 - recorded; the world resyncs and goes on
                failed = 1
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:800])
                traceback.print_exc()
            if self.agree_failed(failed) and row["status"] == "ok":
                row.update(status="peer_error", error="another rank failed this point")
            rows.append(row)
        return rows

    _inputs_key = None

    def inputs(self, M, N, K):
        key = (M, N, K)
        if self._inputs_key != key:
            self._inputs = None
            if self.cuda:
                self.torch.cuda.empty_cache()
            self._inputs = operands(M, N, K, self.W, self.rank, self.dtype, self.plan["seed"], self.device)
            self._inputs_key = key
        return self._inputs

    # ---- the overlap study (--shape-set llm / llm-reduced) -----------------
    def overlap_fns(self, M, N, K):
        """{method: (call, config dict)} of one LLM shape: our variants by name, cuBLAS + NCCL (the
        all-gather into a buffer made once, then the permute into C), cuBLAS alone on this rank's
        block, and NCCL's all-gather of that block alone."""
        import dataclasses

        from kernels.gemm_scatter import column_blocks, gemm_all_scatter, heuristic

        torch, W = self.torch, self.W
        a, bs = self.inputs(M, N, K)
        b = bs[self.rank]
        n = N // W
        rule = heuristic(M, n, K, self.dtype)
        cfgs = {"fused": rule, "senders": dataclasses.replace(rule, variant="senders", split_k=1, swap_ab=False),
                "sequential": dataclasses.replace(rule, variant="sequential"), "auto": None}
        fns = {}
        for name, cfg in cfgs.items():
            fns[name] = ((lambda cfg=cfg: gemm_all_scatter(a, b, self.heap, config=cfg)),
                         cfg.as_params() if cfg is not None else None)
        c_loc = torch.empty((M, n), device=self.device, dtype=self.dtype)
        gathered = torch.empty((W * M, n), device=self.device, dtype=self.dtype)
        c = torch.empty((M, N), device=self.device, dtype=self.dtype)
        group = None if self.heap.simulated else self.heap.group

        def cublas_nccl():
            torch.mm(a, b, out=c_loc)
            self.tdist.all_gather_into_tensor(gathered, c_loc, group=group)
            return column_blocks(gathered, W, c)

        fns["cublas+nccl"] = (cublas_nccl, {"variant": "nccl"})
        fns["cublas_alone"] = ((lambda: torch.mm(a, b, out=c_loc)), None)
        fns["nccl_all_gather"] = ((lambda: self.tdist.all_gather_into_tensor(gathered, c_loc, group=group)), None)
        return fns

    def overlap_check(self, name, fn, ref, base):
        """One call against the fp32 reference (C poisoned first); every rank learns any failure."""
        from kernels.gemm_scatter import out_buffer
        from kernels.gemm_scatter.launch import check_gemm_all_scatter

        row = {"kind": "check", "variant": name, "rank": self.rank, **base}
        self.stage(f"check {name} {base['M']}x{base['N']}x{base['K']}")
        try:
            if name in OVERLAP_OURS:
                out_buffer(self.heap, base["M"], base["N"], self.dtype).view(self.torch.uint8).fill_(0xFF)
            self.heap.barrier()
            got = fn().float().clone()
            check_gemm_all_scatter(self.heap)
            self.heap.barrier()
            err = (got - ref).abs()
            bad = int((~(err <= 3e-2 + 2e-2 * ref.abs())).sum())
            row.update(ok=bad == 0, bad_elements=bad, max_abs_err=float(err.nan_to_num(1e30).max()), error="")
        except Exception as exc:  # noqa: BLE001 - recorded; the world recovers
            traceback.print_exc()
            row.update(ok=False, bad_elements=-1, error=f"{type(exc).__name__}: {exc}"[:500])
        if self.agree_failed(not row["ok"]):
            row["ok"] = False
        return row

    def overlap_case(self, M, N, K, extra, modes):
        """Check, then time every method of one shape in rotating passes per mode (rows: kind time)."""
        from kernels.gemm_scatter import reference
        from kernels.gemm_scatter.launch import check_gemm_all_scatter

        base = {"study": "overlap", "M": M, "N": N, "K": K, "n_local": N // self.W, "world_size": self.W,
                "dtype": self.plan["dtype"], **extra}
        fns = self.overlap_fns(M, N, K)
        a, bs = self.inputs(M, N, K)
        ref = reference(a, bs)
        checks, live = [], []
        for name, (fn, _) in fns.items():
            if name in ("cublas_alone", "nccl_all_gather"):
                live.append(name)
                continue
            row = self.overlap_check(name, fn, ref, base)
            checks.append(row)
            if row["ok"] or name not in OVERLAP_OURS:   # a library is timed even where it is off
                live.append(name)
        del ref
        accurate = {r["variant"]: bool(r["ok"]) for r in checks}
        flop = 2 * M * N * K / self.W
        rows = []
        for mode in modes:
            def time_one(name, first, mode=mode):
                def measure():
                    t = self.time_point(fns[name][0], mode, flop, passes=PASSES)
                    check_gemm_all_scatter(self.heap)
                    return t

                return overlap.guarded(measure, self.agree_failed)

            got, failed = overlap.rotating_passes(
                live, time_one, PASSES, stage=lambda text, mode=mode: self.stage(f"{mode} {M}x{N}x{K}: {text}"))
            rows += overlap.pass_rows(
                live, got, failed,
                lambda name: dict(base, kind="time", variant=name, timing=mode,
                                  config=json.dumps(fns[name][1]) if fns[name][1] else "",
                                  within_tolerance=accurate.get(name)),
                ok_extra=lambda t: {"tflops": 2 * M * N * K / (t["ms"] * 1e9)})
        return checks, rows

    def run_overlap(self):
        modes = self.plan["modes"]
        checks = []
        todo = overlap.shapes("gemm_scatter", self.W, self.args.shape_set, getattr(self.args, "random_shapes", 0),
                              getattr(self.args, "random_seed", None))
        for i, r in enumerate(todo):
            if self.over_budget():
                self.skipped = len(todo) - i
                break
            shape = (r["M"], r["N"], r["K"])
            self.stage(f"overlap {i} {shape}: inputs and methods")
            self.heap.reset()
            c, rows = self.overlap_case(*shape, {"layer": r["layer"], "split": r["split"]}, modes)
            checks += c
            self.rows += rows
        allrows = [None] * self.W
        self.tdist.all_gather_object(allrows, checks)
        return [row for part in allrows for row in part]

    def run(self):
        torch = self.torch
        if getattr(self.args, "shape_set", "seed") in overlap.SET_NAMES and not self.args.check_only:
            return self.run_overlap()
        checks = [] if self.args.skip_checks else self.checks()
        if self.args.check_only:
            return checks
        if self.cuda:  # clocks up before the first timed point
            self.stage("clocks up (1 s of GEMMs)")
            a = torch.randn(4096, 4096, device=self.device, dtype=self.dtype)
            t = time.time()
            while time.time() - t < 1.0:
                a @ a
            torch.cuda.synchronize()
            del a
        points = self.plan["points"]
        done_baselines = set()
        last_shape = None
        for i, p in enumerate(points):
            if self.over_budget():
                self.skipped = len(points) - i
                break
            shape = (p["M"], p["N"], p["K"])
            self.stage(f"point {i}/{len(points)} {p['study']} {shape}")
            if shape != last_shape:
                self.heap.reset()  # C and gather buffers of the last shape
                last_shape = shape
            if p["baselines"] and shape not in done_baselines:
                for b in self.plan["baselines"]:
                    self.rows += self.measure("baseline", *shape, b)
                done_baselines.add(shape)
            self.rows += self.measure(p["study"], *shape, "fused", p["config"], p["hints"])
            if self.rank == 0 and i % 50 == 0:
                print(f"[{time.time() - self.t0:6.0f} s] point {i}/{len(points)} {p['study']} {shape}", flush=True)
        return checks


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------
def summarize(times):
    """Per (world size, shape, timing): the default fused call against cuBLAS + NCCL,
    our GEMM + our all-gather and the GEMM alone; the best fused config too."""
    import pandas as pd

    ok = times[(times["status"] == "ok")]
    if ok.empty:
        return pd.DataFrame()
    rows = []
    base = ok[ok["study"] == "baseline"]
    for (W, M, N, K, timing), g in base.groupby(["world_size", "M", "N", "K", "timing"]):
        fused = ok[(ok["variant"] == "fused") & (ok["M"] == M) & (ok["N"] == N) & (ok["K"] == K)
                   & (ok["timing"] == timing) & (ok["world_size"] == W)]
        default = fused[fused["study"].isin(["m_sweep", "shapes", "weak"])]
        if default.empty:
            continue
        ms = {v: g[g["variant"] == v]["ms"].min() for v in BASELINES}
        d = default["ms"].min()
        best = fused.loc[fused["ms"].idxmin()]
        rows.append({"world_size": W, "M": M, "N": N, "K": K, "timing": timing, "fused_ms": d,
                     "fused_config": default.iloc[0].get("config"), "best_fused_ms": best["ms"],
                     "best_config": best.get("config"), **{f"{v}_ms": ms[v] for v in BASELINES},
                     "speedup_vs_cublas_nccl": ms["cublas+nccl"] / d,
                     "speedup_vs_triton_all_gather": ms["triton+all_gather"] / d,
                     "vs_gemm_alone": d / min(ms["cublas_alone"], ms["triton_alone"]),
                     "fused_tflops": 2 * M * N * K / (d * 1e9)})
    return pd.DataFrame(rows)


CASE_KEYS = ["world_size", "M", "N", "K"]


def summarize_overlap(times):
    """Per (shape, timing) of the overlap study: every method's ms, ours against cuBLAS + NCCL and
    against max(GEMM alone, all-gather alone) (the issue's bound: at most 1.2x at M >= 256), and
    comm hidden = (T_gemm + T_comm - T) / T_comm with T_gemm = cuBLAS on this rank's block and
    T_comm = NCCL's all-gather of it."""
    import pandas as pd

    ok = times[(times["status"] == "ok") & (times["study"] == "overlap")]
    rows = []
    for case, ms, g in overlap.per_case(ok, CASE_KEYS):
        row = dict(case, layer=g["layer"].iloc[0], split=g["split"].iloc[0], **{f"{v}_ms": t for v, t in ms.items()})
        floor = max(ms.get("cublas_alone", math.nan), ms.get("nccl_all_gather", math.nan))
        for v in OVERLAP_OURS + ("cublas+nccl",):
            if v in ms:
                row[f"{v}_speedup_vs_cublas+nccl"] = ms.get("cublas+nccl", math.nan) / ms[v]
                row[f"{v}_vs_max_alone"] = ms[v] / floor
                row[f"{v}_comm_hidden"] = overlap.comm_hidden(ms.get("cublas_alone"), ms.get("nccl_all_gather"), ms[v])
        best = overlap.best_of(ms, ("fused", "senders", "sequential"))
        if best:
            row["best_ours"] = best
            row["best_ours_ms"] = ms[best]
        rows.append(row)
    return pd.DataFrame(rows)


def model_features(case: dict) -> dict:
    """A case's features for the choice model (``kernels.gemm_scatter.config.model_features``;
    a case's N is the whole C's, each rank computing N / W columns)."""
    from kernels.gemm_scatter.config import model_features as features

    W = int(case["world_size"])
    return features(int(case["M"]), int(case["N"]) // W, int(case["K"]), W)


GEMM_SCATTER = overlap.Study(family="gemm_scatter", name="gemm_all_scatter",
                             script="experiments/run_gemm_scatter.py", keys=tuple(CASE_KEYS),
                             match_keys=("world_size",), choices=CHOICES, libraries=("cublas+nccl",),
                             gemm="cublas_alone", comm="nccl_all_gather", fused=("fused", "senders"),
                             features=model_features)


def overlap_rows(times):
    """The overlap study's rows of a times table (the other studies' left out), each the slowest
    rank's median already: rank 0's, as the shared scoring (``overlap``) reads them."""
    return times[times["study"] == "overlap"].assign(rank=0)


def fit_and_hold_out(times, out: Path, W: int, model_splits: tuple = ("fit",)) -> list[str]:
    """The variant choice fitted on the fit half's eager calls (auto_table.json, which
    kernels/gemm_scatter/config.py reads from results/gemm_scatter/), scored on the held-out
    half (held_out_wW.csv), both halves in variant_choice_wW.csv (``overlap.fit_and_hold_out``)."""
    ov = overlap_rows(times)
    configs = {v: json.loads(c) for v, c in zip(ov["variant"], ov["config"]) if isinstance(c, str) and c}
    return overlap.fit_and_hold_out(GEMM_SCATTER, ov, out, configs, suffix=f"_w{W}",
                                    source="experiments/run_gemm_scatter.py --shape-set: fit, eager",
                                    how="eager calls, the slowest rank's median, fit half", model_splits=model_splits)


def write_tables(rows, checks, out: Path, W: int, prov: dict, skipped: int, command: str = ""):
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    extra = {**prov, "command": command or " ".join(["torchrun", f"--nproc-per-node {W}"] + sys.argv)}
    times = pd.DataFrame(rows)
    for df in (times,):
        for k, v in extra.items():
            df[k] = v if not isinstance(v, (list, dict)) else json.dumps(v)
    written = []
    if len(checks):
        c = pd.DataFrame(checks)
        for k, v in extra.items():
            c[k] = v if not isinstance(v, (list, dict)) else json.dumps(v)
        c.to_csv(out / f"checks_w{W}.csv", index=False)
        written.append(f"checks_w{W}.csv")
    if len(times) and (times.get("study") == "overlap").any():
        times.to_csv(out / f"times_w{W}.csv", index=False)
        summary = summarize_overlap(times)
        summary.to_csv(out / f"summary_w{W}.csv", index=False)
        written += [f"times_w{W}.csv", f"summary_w{W}.csv"] + fit_and_hold_out(times, out, W)
    elif len(times):
        times.to_csv(out / f"times_w{W}.csv", index=False)
        written.append(f"times_w{W}.csv")
        summary = summarize(times)
        if len(summary):
            summary.to_csv(out / f"summary_w{W}.csv", index=False)
            written.append(f"summary_w{W}.csv")
    info = pd.DataFrame([{**extra, "skipped_points": skipped, "rows": len(times)}])
    info.to_csv(out / f"info_w{W}.csv", index=False)
    written.append(f"info_w{W}.csv")
    return times, written


def report(times, checks, W, skipped):
    import pandas as pd

    pd.set_option("display.width", 220)
    if len(checks):
        c = pd.DataFrame(checks)
        bad = c[~c["ok"].astype(bool)]
        print(f"checks: {len(c) - len(bad)}/{len(c)} within bf16 tolerance of the fp32 product (all ranks)")
        if len(bad):
            print(bad[[k for k in ["rank", "variant", "config", "hints", "M", "N", "K", "bad_elements", "error"]
                       if k in bad]].to_string(index=False))
    if times is None or times.empty:
        return
    ok = times[times["status"] == "ok"]
    if (ok.get("study") == "overlap").any():
        s = summarize_overlap(times)
        cols = [c for c in ["timing", "M", "N", "K", "split", "fused_ms", "senders_ms", "cublas+nccl_ms",
                            "cublas_alone_ms", "nccl_all_gather_ms", "best_ours", "fused_comm_hidden",
                            "senders_comm_hidden"] if c in s]
        print(s[cols].round(4).to_string(index=False))
        return
    fused = ok[ok["variant"] == "fused"]
    print(f"world size {W}: {len(times)} rows, {len(fused)} fused points "
          f"({len(fused[fused['study'] == 'scatter'])} in the scatter study), {skipped} points skipped (budget), "
          f"{int((times['status'] == 'error').sum())} errors")
    s = summarize(times)
    if len(s):
        cols = ["timing", "M", "N", "K", "fused_ms", "cublas+nccl_ms", "cublas_alone_ms", "speedup_vs_cublas_nccl",
                "vs_gemm_alone", "fused_tflops"]
        print(s[cols].round(4).to_string(index=False))
    h = ok[ok["study"] == "hints"]
    if len(h):
        piv = h.pivot_table(index=["timing", "block_m", "block_n"], columns="hints", values="ms", aggfunc="median")
        if {True, False} <= set(piv.columns):
            piv["gain"] = piv[False] / piv[True]
            print("hints (median ms over the seed shapes):")
            print(piv.round(4).to_string())


def worker(args) -> int:
    """One rank (under torchrun or workbench.dist.launch): run, rank 0 writes the tables."""
    from workbench import dist, provenance

    with dist.worker() as w:
        r = Runner(args, stage=w.stage)
        checks = r.run()
        w.stage("tables")
        if r.rank == 0:
            # every rank holds the same timings (the slowest rank's, from time_collective): rank 0 writes
            prov = provenance.flat(provenance.collect(world_size=r.W))
            times, written = write_tables(r.rows, checks, Path(args.out), r.W, prov, r.skipped, args.command)
            report(times, checks, r.W, r.skipped)
            print("wrote", ", ".join(written), "to", args.out, flush=True)
        if r.cuda:
            r.torch.cuda.synchronize()
        w.stage("done")
    failed = bool(checks) and not all(c["ok"] for c in checks)
    return 1 if failed else 0


def parent(args, argv) -> int:
    """One world per size through workbench.dist.launch (no torchrun needed to start this script)."""
    import torch

    from workbench import dist

    out = Path(args.out).resolve()
    sizes = [int(s) for s in args.world_sizes.split(",") if s.strip()]
    have = torch.cuda.device_count()
    command = " ".join(["python", str(Path(__file__).resolve().relative_to(REPO)), *argv])
    fwd = ["--worker", "--out", str(out), "--spec", str(Path(args.spec).resolve()), "--budget-s", str(args.budget_s),
           "--heap-mib", str(args.heap_mib), "--command", command]
    fwd += ["--quick"] * args.quick + ["--check-only"] * args.check_only + ["--skip-checks"] * args.skip_checks
    fwd += ["--studies", args.studies] if args.studies else []
    fwd += ["--shape-set", args.shape_set] if args.shape_set != "seed" else []
    fwd += ["--random-shapes", str(args.random_shapes), "--random-seed", str(args.random_seed)] * bool(
        args.random_shapes)
    failed, ran = [], 0
    for W in sizes:
        if have < W:
            print(f"world size {W}: skipped, this machine has {have} GPU(s)", flush=True)
            continue
        t0 = time.time()
        print(f"world size {W}: launching ...", flush=True)
        _, err = dist.launch_rows(Path(__file__), W, fwd, timeout_s=args.timeout, echo=True)
        ran += 1
        if err:
            print(err, flush=True)
            failed.append(W)
        print(f"world size {W}: done in {time.time() - t0:.0f} s{' (FAILED)' if err else ''}", flush=True)
    if not ran:
        print("no world ran (too few GPUs for every size asked)", flush=True)
        return 1
    if failed:
        print(f"FAILED: world size(s) {', '.join(map(str, failed))}: a rank failed, a check missed its tolerance, "
              f"or the world ran past --timeout {args.timeout:g} s (see above)", flush=True)
        return 1
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "results" / "gemm_scatter"), help="folder for the CSVs")
    ap.add_argument("--spec", default=str(SPEC), help="experiment spec (default experiments/gemm_scatter.yaml)")
    ap.add_argument("--quick", action="store_true", help="the spec's quick shape sets (a smoke run)")
    ap.add_argument("--shape-set", default="seed", choices=("seed",) + overlap.SET_NAMES,
                    help="seed: the spec's studies (default); llm / llm-reduced: the overlap study on the LLM "
                         "tensor-parallel set of experiments/overlap.py (every variant and baseline in rotating "
                         "passes, comm hidden, a variant choice fitted on the fit half and scored on the held-out "
                         "half: auto_table.json, held_out_wW.csv, variant_choice_wW.csv)")
    ap.add_argument("--random-shapes", type=int, default=0,
                    help="with --shape-set: this many shapes besides, drawn at run time (M uniform in [128, 16384], "
                         "N and K multiples of 128 in [1024, 16384]; split 'random', scored, never fitted)")
    ap.add_argument("--random-seed", type=int, default=None,
                    help="their seed (default: drawn at run time and printed; under plain torchrun: required)")
    ap.add_argument("--studies", default="", help="comma-separated studies to run (default: all)")
    ap.add_argument("--check-only", action="store_true", help="only the correctness checks")
    ap.add_argument("--skip-checks", action="store_true", help="no correctness checks (timing only)")
    ap.add_argument("--budget-s", type=float, default=480,
                    help="stop starting points after this many seconds in a world (default 480)")
    ap.add_argument("--heap-mib", type=int, default=512, help="symmetric heap per GPU (MiB)")
    ap.add_argument("--world-sizes", default="2",
                    help="without torchrun: comma-separated world sizes, one world each (default 2)")
    ap.add_argument("--timeout", type=float, default=570,
                    help="without torchrun: seconds per world before it is killed (default 570)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--command", default="", help=argparse.SUPPRESS)  # the parent's command line (provenance)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    args.random_seed = overlap.random_seed(ap, args, worker=args.worker or "RANK" in os.environ)
    if args.worker or "RANK" in os.environ:  # under workbench.dist.launch or plain torchrun
        return worker(args)
    return parent(args, argv)


if __name__ == "__main__":
    sys.exit(main())
