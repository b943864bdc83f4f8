"""The one driver of the two overlap studies (``run_ag_gemm.py`` and ``run_gemm_scatter.py``),
for what they do alike; each script keeps only what is its own (its methods, checks, sweeps
and tables' columns):

- every rank together: a failure anywhere learnt by every rank (`any_rank`, `guarded`), the
  time budget (`budget_passed`), so the ranks stay in step;
- timing a case's methods in rotating passes (`rotating_passes`, `pass_rows`), each pass of
  each method marked as the rank's stage so a launch that hangs names it;
- a summary row per case (`per_case`, `comm_hidden`, `best_of`);
- with ``--shape-set llm`` or ``llm-reduced``: the LLM tensor-parallel shape set and its fit /
  held-out split (`shapes`), the variant choice fitted on the fit half and scored on the other
  (`fit_and_hold_out`: auto_table.json, the tuning tables, held_out*.csv, variant_choice*.csv
  and the summary lines), each family described by a `Study`.

**Shapes.** The column-parallel GEMMs of tensor-parallel LLM layers, (N of the whole layer,
K = the hidden size or the MLP width): QKV and gate+up projections of Llama-3 70B and 405B,
Qwen2.5-72B and Qwen3-32B, DeepSeek-V3's dense MLP (gate+up, and down with K = 18432);
M = tokens, powers of two from 256 (from 1 for GEMM + all-scatter) to 16384 plus M = 1000
and 3000. All-gather + GEMM: each rank's B is its column shard, N = N_layer / W; GEMM +
all-scatter: C has the layer's N columns, each rank computes N_layer / W of them.

**The split** (fixed, stated before any measurement): the family's layers in the order listed
and its M values ascending; shape (layer i, M j) is in the fit half when i + j is even, held
out when odd. A checkerboard: every layer and every size of M appear in both halves, and no
held-out shape was seen by the fit.

``llm-reduced`` is the subset one command on a 2-GPU node measures in a few minutes (layers
and M listed in REDUCED, problems up to REDUCED_FLOP per rank); ``llm`` is the whole set
(a budgeted run of its own).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
import traceback
from pathlib import Path
from typing import Callable

LAYERS = {  # name: (N of the whole layer, K)
    "llama3-70b.qkv": (10240, 8192), "llama3-70b.gate_up": (57344, 8192),
    "llama3-405b.qkv": (18432, 16384), "llama3-405b.gate_up": (106496, 16384),
    "qwen2.5-72b.qkv": (10240, 8192), "qwen2.5-72b.gate_up": (59136, 8192),
    "qwen3-32b.qkv": (10240, 5120), "qwen3-32b.gate_up": (51200, 5120),
    "deepseek-v3.dense.gate_up": (36864, 7168), "deepseek-v3.dense.down": (7168, 18432),
}
TOKENS = {"ag_gemm": (256, 512, 1000, 1024, 2048, 3000, 4096, 8192, 16384),
          "gemm_scatter": (1, 16, 64, 256, 1000, 1024, 3000, 4096, 16384)}
REDUCED = {  # (layers, M values) of llm-reduced
    "ag_gemm": (("llama3-70b.qkv", "qwen3-32b.qkv", "deepseek-v3.dense.down", "llama3-405b.qkv"),
                (256, 1000, 4096, 16384)),
    "gemm_scatter": (("llama3-70b.qkv", "qwen3-32b.qkv", "deepseek-v3.dense.down"), (1, 64, 256, 1000, 4096, 16384)),
}
REDUCED_FLOP = 1.5e12   # per rank: about 2-3 ms of an H100's GEMM, so a case's passes stay short
SET_NAMES = ("llm", "llm-reduced")


RANDOM_M, RANDOM_NK = (128, 16384), (1024, 16384)   # shapes drawn at run time: M uniform, N and K by 128


def random_shapes(family: str, world_size: int, n: int, seed: int) -> list[dict]:
    """``n`` shapes no table or fit has seen, drawn from ``seed``: M uniform in [128, 16384] (then
    up to a multiple of the world size, which all-gather + GEMM's shards need), N and K multiples of
    128 in [1024, 16384]; rows {layer: 'random(seed=S)', M, N, K, split: 'random'}. For all-gather
    + GEMM, N is each rank's B columns; for GEMM + all-scatter, C's (a multiple of 128, so of W)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        M = rng.randint(*RANDOM_M)
        M = -(-M // world_size) * world_size if family == "ag_gemm" else M
        N, K = (128 * rng.randint(lo // 128, hi // 128) for lo, hi in (RANDOM_NK, RANDOM_NK))
        rows.append({"layer": f"random(seed={seed})", "M": M, "N": N, "K": K, "split": "random"})
    return rows


def shapes(family: str, world_size: int, which: str = "llm-reduced", random: int = 0,
           seed: int | None = None) -> list[dict]:
    """The shape set's problems for ``family`` ("ag_gemm" or "gemm_scatter") at ``world_size``:
    rows {layer, M, N, K, split} in the order they are measured: fit and held-out interleaved,
    and M from both ends of its range in turn (smallest, largest, next smallest, ...), so that a
    run its time budget cuts short has still measured small and large problems of both halves.
    ``random``: that many shapes of ``random_shapes(seed)`` besides, taken in turn with the set's."""
    if random:
        if seed is None:
            raise ValueError("random shapes need their seed (--random-seed), so that every rank draws the same")
        set_rows, extra = shapes(family, world_size, which), random_shapes(family, world_size, random, seed)
        both = [r for pair in itertools.zip_longest(set_rows, extra) for r in pair if r is not None]
        return both
    if which not in SET_NAMES:
        raise ValueError(f"shape set must be one of {SET_NAMES}, got {which!r}")
    layers, tokens = (REDUCED[family] if which == "llm-reduced" else (tuple(LAYERS), TOKENS[family]))
    rows, seen = [], set()
    ends = [k for pair in zip(range(len(tokens)), reversed(range(len(tokens)))) for k in pair]
    for j in list(dict.fromkeys(ends)):
        M = tokens[j]
        for i, layer in enumerate(layers):
            n_layer, K = LAYERS[layer]
            N = n_layer // world_size if family == "ag_gemm" else n_layer
            if family == "ag_gemm" and (M % world_size or K % world_size):
                continue
            if which == "llm-reduced" and 2 * M * (n_layer // world_size) * K > REDUCED_FLOP:
                continue
            if (M, N, K) in seen:   # two models' layers of one shape (Llama-3 70B's and Qwen2.5-72B's QKV):
                continue            # once, in the first one's half (a held-out shape is never a fitted one)
            seen.add((M, N, K))
            rows.append({"layer": layer, "M": M, "N": N, "K": K, "split": "fit" if (i + j) % 2 == 0 else "held_out"})
    return rows


def random_seed(ap, args, worker: bool) -> int | None:
    """The seed of ``--random-shapes``: ``--random-seed``, else drawn here and printed (the parent
    passes it to every rank; a rank under plain torchrun cannot draw its own)."""
    if not getattr(args, "random_shapes", 0):
        return args.random_seed
    if args.random_shapes < 0 or getattr(args, "shape_set", "seed") not in SET_NAMES:
        ap.error("--random-shapes: a count >= 0, with --shape-set llm or llm-reduced")
    if args.random_seed is None:
        if worker:
            ap.error("--random-shapes under torchrun: pass --random-seed (every rank must draw the same shapes)")
        import secrets

        args.random_seed = secrets.randbelow(1 << 31)
    print(f"random shapes: {args.random_shapes}, seed {args.random_seed}", flush=True)
    return args.random_seed


# --------------------------------------------------------------------------
# Every rank together
# --------------------------------------------------------------------------
def any_rank(flag, device) -> bool:
    """Whether ``flag`` holds on any rank (every rank learns the same answer, so they stay in step)."""
    import torch
    import torch.distributed as tdist

    t = torch.tensor([int(bool(flag))], device=device)
    tdist.all_reduce(t)
    return bool(t.item())


def budget_passed(t0: float, budget_s: float | None, device) -> bool:
    """Whether ``budget_s`` seconds since ``t0`` have passed on any rank (None: no budget)."""
    if budget_s is None:
        return False
    import torch
    import torch.distributed as tdist

    t = torch.tensor([float(time.time() - t0 > budget_s)], device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item())


def guarded(call: Callable[[], object], failed_anywhere: Callable[[bool], bool]) -> tuple:
    """``(call(), None)``, or ``(None, (status, error))`` where it raised on this rank ("error",
    the traceback printed) or on another ("peer_error"). ``failed_anywhere(failed_here)`` tells
    every rank whether any failed (and brings the shared state back when one did)."""
    value, err = None, ""
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - recorded; the world recovers and goes on
        traceback.print_exc()
        err = f"{type(exc).__name__}: {exc}"[:800]
    if failed_anywhere(bool(err)):
        return None, ("error", err) if err else ("peer_error", "another rank failed this point")
    return value, None


# --------------------------------------------------------------------------
# Timing in rotating passes
# --------------------------------------------------------------------------
def rotating_passes(names: list, time_one, passes: int,
                    stage: Callable[[str], None] | None = None) -> tuple[dict, dict]:
    """Time every method of a case in ``passes`` passes over all of them, the first method
    rotating, so that no method is always timed first or last (timed one block after
    another, the same configuration measured up to 12% slower as the fifth method of a case
    than as the first: the GPU's clocks after the methods before it). ``time_one(name,
    first_pass)`` returns (timing dict, None) or (None, (status, error)); a method that fails
    is dropped from the later passes. ``stage(text)`` is told each pass and method before it
    is timed (a rank's heartbeat). Returns ({name: [timings]}, {name: failure})."""
    got = {n: [] for n in names}
    failed = {}
    for p in range(passes):
        for name in names[p % len(names):] + names[:p % len(names)] if names else []:
            if name in failed:
                continue
            if stage is not None:
                stage(f"pass {p + 1}/{passes} {name}")
            t, failure = time_one(name, p == 0)
            if t is None:
                failed[name] = failure
            else:
                got[name].append(t)
    return got, failed


def pass_rows(names: list, got: dict, failed: dict, row_of: Callable[[str], dict],
              ok_extra: Callable[[dict], dict] | None = None) -> list[dict]:
    """One row per method of a case from `rotating_passes`: ``row_of(name)`` (the row's fixed
    fields) with the failure's status and error, or the median of its passes, status ok and
    ``ok_extra(timing)``."""
    rows = []
    for name in names:
        row = row_of(name)
        if name in failed:
            row.update(status=failed[name][0], error=failed[name][1])
        else:
            t = median_of_passes(got[name])
            row.update(t, status="ok", error="", **(ok_extra(t) if ok_extra else {}))
        rows.append(row)
    return rows


def median_of_passes(ts: list[dict]) -> dict:
    """A method's row from its passes (each the slowest rank's median): medians of them."""
    return {"ms": statistics.median(t["ms"] for t in ts), "q25_ms": statistics.median(t["q25_ms"] for t in ts),
            "q75_ms": statistics.median(t["q75_ms"] for t in ts), "loop_ms": statistics.fmean(t["loop_ms"] for t in ts),
            "slowest_rank": max(ts, key=lambda t: t["ms"])["slowest_rank"], "passes": len(ts)}


def comm_hidden(t_gemm: float, t_comm: float, t: float) -> float:
    """The share of the collective's time a method hides: (T_gemm + T_comm - T) / T_comm
    (1: all of it, the method as fast as the GEMM alone; 0: none, as slow as the two in turn)."""
    if not (t_comm and t_comm > 0) or any(x is None or x != x for x in (t_gemm, t_comm, t)):
        return math.nan
    return (t_gemm + t_comm - t) / t_comm


def per_case(ok, keys: list[str]):
    """(case, {method: ms}, rows) per (keys..., timing) group of a benchmark's ok rows; ``case``
    maps the keys and ``timing`` to the group's values."""
    for key, g in ok.groupby(keys + ["timing"]):
        yield dict(zip(keys + ["timing"], key)), dict(zip(g["variant"], g["ms"])), g


def best_of(ms: dict, names) -> str | None:
    """The fastest of ``names`` that has a time in ``ms`` (None when none has)."""
    have = {n: ms[n] for n in names if n in ms}
    return min(have, key=have.get) if have else None


def graph_replay_result(fn):
    """``fn()``'s result from one replay of a CUDA graph that captured it (``workbench.bench.
    capture``); every rank of a collective calls this together."""
    import torch

    from workbench.bench import capture

    replay, out = capture(fn)
    replay()
    torch.cuda.synchronize()
    return out.clone()


# --------------------------------------------------------------------------
# The variant choice: fitted on the fit half, scored on the held-out half
# --------------------------------------------------------------------------
def case_times(bench, keys: list[str]) -> dict:
    """{(case key..., timing): {method: ms}} from a benchmark's rows (rank 0, status ok)."""
    ok = bench[(bench["status"] == "ok") & (bench["rank"] == 0)] if "rank" in bench else bench[bench["status"] == "ok"]
    out = {}
    for key, g in ok.groupby(keys + ["timing"]):
        out[key] = dict(zip(g["variant"], g["ms"]))
    return out


def fit_choices(bench, keys: list[str], choices: tuple, configs: dict, timing: str = "both") -> list[dict]:
    """Per fit case: the method of ``choices`` to run, among those within the dtype's tolerance
    there (PyTorch's fused op misses it along K at 4 ranks), as a table entry {keys..., method,
    config, ms (its eager time)}; ``configs[method]`` is the config it ran with.

    ``timing="both"`` (default): the method whose worse regret over eager calls and CUDA-graph
    replays is least (a user's loop may be either, and the choice cannot know which: one fitted on
    eager calls alone lost 14-16% graph-replayed on the first H200 runs' held-out half); "eager"
    or "graph": the fastest in that mode alone."""
    fit = bench[bench["split"] == "fit"] if "split" in bench else bench.iloc[:0]
    if "within_tolerance" in fit:   # never choose a method that missed the dtype's tolerance there
        fit = fit[fit["within_tolerance"].astype("string").fillna("True").str.lower() != "false"]
    modes = ("eager", "graph") if timing == "both" else (timing,)
    per_case: dict = {}
    for key, ms in case_times(fit, keys).items():
        if key[-1] in modes:
            per_case.setdefault(key[:-1], {})[key[-1]] = {m: t for m, t in ms.items() if m in choices}
    entries = []
    for case, by_mode in per_case.items():
        common = set.intersection(*(set(by_mode.get(m, {})) for m in modes))
        if not common:
            continue
        best = {m: min(by_mode[m][x] for x in common) for m in modes}
        pick = min(sorted(common), key=lambda x: max(by_mode[m][x] / best[m] for m in modes))
        ms = by_mode.get("eager", by_mode[modes[0]])[pick]
        entries.append({**{k: (int(v) if isinstance(v, (int, float)) and k != "layer" else v)
                           for k, v in zip(keys, case) if k != "layer"},
                        "method": pick, "config": configs.get(pick, {"variant": pick}), "ms": float(ms)})
    return entries


def nearest(entries: list[dict], M: int, N: int, K: int, **match) -> dict | None:
    """The entry nearest in log2 M, N, K among those whose fields equal ``match`` (the rule
    ``auto_config`` applies to the tables: ``kernels.comm.choices.nearest``)."""
    from kernels.comm import choices

    return choices.nearest(entries, M, N, K, **match)


def score_held_out(bench, entries: list[dict], keys: list[str], match_keys: list[str], ours: tuple,
                   libraries: tuple, gemm: str, comm: str, fused: tuple = (), *,
                   pick: Callable[[dict, str], str | None] | None = None, split: str = "held_out",
                   keep_failed: bool = False):
    """One row per case of ``split`` ("held_out", or "random": shapes drawn at run time) and
    timing: the choice (``pick(case, timing)``; default: the nearest fit entry's method), its
    time, the fastest of ``ours`` (every method the choice picks from, where within the dtype's
    tolerance on that shape) and of the libraries there, the choice's regret and speedups, and the
    comm hidden of the choice and of each library. ``fused``: our fused kernels alone (their best
    beside the best library says where the kernels stand when the choice falls back to a library).
    ``keep_failed``: a pick that has no time there or missed the tolerance (the launcher's own
    choice, ``auto``, is not timed where its check failed) is a row with ``failed`` set, not
    dropped."""
    import pandas as pd

    def by_nearest(case, timing):
        e = nearest(entries, int(case["M"]), int(case["N"]), int(case["K"]), **{k: case[k] for k in match_keys})
        return None if e is None else e["method"]

    pick = pick or by_nearest
    held = bench[bench["split"] == split] if "split" in bench else bench.iloc[:0]
    missed = _missed_tolerance(held, keys)
    rows = []
    for key, ms in case_times(held, keys).items():
        case = dict(zip(keys, key[:-1]))
        method = pick(case, key[-1])
        if keep_failed and method is not None and (method not in ms or (key[:-1], method) in missed):
            rows.append({**case, "timing": key[-1], "chosen": method, "chosen_ms": math.nan, "failed": True})
            continue
        if method is None or method not in ms:
            continue
        pick_ms = ms[method]
        best_ours = min((t for m, t in ms.items() if m in ours and (key[:-1], m) not in missed), default=math.nan)
        libs = {m: t for m, t in ms.items() if m in libraries}
        best_lib = min(libs.values(), default=math.nan)
        row = {**case, "timing": key[-1], "chosen": method, "chosen_ms": pick_ms, "best_ours_ms": best_ours,
               "regret": pick_ms / best_ours, "best_library": min(libs, key=libs.get) if libs else None,
               "best_library_ms": best_lib, "speedup_vs_best_library": best_lib / pick_ms,
               "gemm_alone_ms": ms.get(gemm), "collective_alone_ms": ms.get(comm),
               "comm_hidden_chosen": comm_hidden(ms.get(gemm), ms.get(comm), pick_ms), "failed": False}
        if fused:
            best_fused = min((t for m, t in ms.items() if m in fused), default=math.nan)
            row.update(best_fused_ms=best_fused, fused_vs_best_library=best_lib / best_fused,
                       comm_hidden_best_fused=comm_hidden(ms.get(gemm), ms.get(comm), best_fused))
        for m, t in libs.items():
            row[f"{m}_ms"] = t
            row[f"speedup_vs_{m}"] = t / pick_ms
            row[f"comm_hidden_{m}"] = comm_hidden(ms.get(gemm), ms.get(comm), t)
        rows.append(row)
    return pd.DataFrame(rows)


def _missed_tolerance(rows, keys: list[str]) -> set:
    """{(case key, method)} of the rows that missed the dtype's tolerance (rank 0's check)."""
    if "within_tolerance" not in rows:
        return set()
    r = rows[(rows["rank"] == 0) if "rank" in rows else slice(None)]
    bad = r[r["within_tolerance"].astype("string").fillna("True").str.lower() == "false"]
    return {(tuple(k), m) for k, m in zip(bad[keys].itertuples(index=False, name=None), bad["variant"])}


def summary_lines(held, family: str, group: list[str]) -> list[str]:
    """A few lines per (group..., timing) of the held-out score: the geomean and the least
    speedup against the best library, how many shapes reach 1.0x, the regret, and the comm
    hidden where the GEMM alone takes at least as long as the collective alone."""
    if held is None or not len(held):
        return [f"{family}: no held-out case measured"]
    lines = []
    for key, g in held.groupby(group + ["timing"]):
        failed = int(g["failed"].astype(bool).sum()) if "failed" in g else 0
        g = g[~g["failed"].astype(bool)] if failed else g
        sp = g["speedup_vs_best_library"]
        long_gemm = g[g["gemm_alone_ms"] >= g["collective_alone_ms"]]
        hid = long_gemm["comm_hidden_chosen"].clip(lower=1e-3)
        label = " ".join(f"{k}={v}" for k, v in zip(group + ["timing"], key if isinstance(key, tuple) else (key,)))
        lines.append(f"{family} {label}: {len(g)} held-out shapes, vs the best library geomean "
                     f"{_geomean(sp):.2f}x (least {sp.min():.2f}x, {int((sp >= 1.0).sum())} at >= 1.0x), regret "
                     f"geomean {_geomean(g['regret']):.3f} (worst {g['regret'].max():.2f}, "
                     f"{int((g['regret'] <= 1.05).sum())} within 5% of the best candidate), comm hidden geomean "
                     f"{_geomean(hid):.0%} on "
                     f"{len(long_gemm)} shapes whose GEMM is at least the collective"
                     + (f"; {failed} more outside the dtype's tolerance (not timed)" if failed else ""))
        if "fused_vs_best_library" in g:   # our fused kernels alone, whatever the choice picked
            fv = g["fused_vs_best_library"]
            lines.append(f"  our fused kernels alone (the best per shape): geomean {_geomean(fv):.2f}x the best "
                         f"library (least {fv.min():.2f}x), comm hidden geomean "
                         f"{_geomean(long_gemm['comm_hidden_best_fused'].clip(lower=1e-3)):.0%}")
    return lines


def _geomean(s) -> float:
    s = [float(x) for x in s if x == x and x > 0]
    return math.exp(sum(math.log(x) for x in s) / len(s)) if s else math.nan


def write_table(path, entries: list[dict], source: str) -> None:
    path.write_text(json.dumps({"source": source, "entries": entries}, indent=1))


def write_choice_tables(entries: list[dict], rows, out, family: str, keys: list[str], how: str, by: str) -> list[str]:
    """The fitted choices as the selection layer's tuning table (``OUT/tables/<GPU>/<family>.json``,
    ``kernels.comm.choices``): one entry per fit problem, keyed by ``keys`` and the dtype, with the
    run's provenance (from ``rows``). Ship it by merging it into ``kernels/common/tables/``."""
    from kernels.comm import choices

    device = choices.device_of_rows(rows)
    if device is None or not entries:
        return []
    first = rows.iloc[0]
    prov = {"date": str(first.get("timestamp", "")) or None, "git": first.get("git_sha"),
            "torch": first.get("torch_version")}
    dtype = choices.dtype_name("torch." + str(first.get("dtype", "bfloat16")).replace("torch.", ""))
    table = {}
    for e in entries:
        problem = {**{k: int(e[k]) for k in keys}, "dtype": dtype}
        table[choices.key(problem)] = choices.table_entry(e["method"], e["config"], e["ms"], how, by, prov)
    path = choices.write(Path(out) / "tables", device, family, table, first.get("triton_version"))
    return [str(path.relative_to(out))]


# --------------------------------------------------------------------------
# One family's variant choice, from fit to held-out score
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Study:
    """What tells one family's overlap study from the other's, for `fit_and_hold_out`."""

    family: str           # the tuning tables' family (kernels.comm.choices): "ag_gemm", "gemm_scatter"
    name: str             # the summary lines' name: "all_gather_matmul", "gemm_all_scatter"
    script: str           # the script that measures it, for the tables' provenance
    keys: tuple           # a case's fields (world_size, ..., M, N, K)
    match_keys: tuple     # the fields a held-out case's nearest fitted case must share
    choices: tuple        # the methods the choice picks from (ours and the libraries through our launcher)
    libraries: tuple      # the library methods a choice is scored against
    gemm: str             # the GEMM alone (T_gemm of comm hidden)
    comm: str             # the collective alone (T_comm)
    fused: tuple          # our fused kernels, scored alone beside the choice
    # a case's features for the choice model (kernels.comm.choice_model): {flop, gemm_bytes, comm_bytes}
    features: Callable[[dict], dict] | None = None
    # a group's match -> {method: why} the choice model never takes (kernels.comm.choice_model.fit)
    never: Callable[[dict], dict] | None = None


def fit_and_hold_out(study: Study, bench, out: Path, configs: dict, *, suffix: str = "", source: str, how: str,
                     tidy: Callable[[dict], None] | None = None, model_splits: tuple = ("fit",)) -> list[str]:
    """The variant choice fitted on the fit half's calls (``fit_choices``; each entry passed to
    ``tidy`` to clean its config) and written as ``auto_table.json`` (``source`` says where from)
    and as the selection layer's tuning table (``how`` it was measured), then scored on the
    held-out half: ``held_out{suffix}.csv`` (each held-out shape's choice by the nearest fitted
    shape, against the best of ours and of the libraries, eager and graph-replayed, with comm
    hidden), ``variant_choice{suffix}.csv`` (both halves) and the summary lines, printed.
    ``model_splits``: the splits the choice model is fitted on (``model_and_scores``).
    Returns the files written, relative to ``out``."""
    import pandas as pd

    keys, out = list(study.keys), Path(out)
    entries = fit_choices(bench, keys, study.choices, configs)
    for e in entries if tidy else ():
        tidy(e)
    write_table(out / "auto_table.json", entries, source)
    tables = write_choice_tables(entries, bench, out, study.family, keys, how, study.script)
    held = score_held_out(bench, entries, keys, list(study.match_keys), study.choices, study.libraries, study.gemm,
                          study.comm, fused=study.fused)
    held.to_csv(out / f"held_out{suffix}.csv", index=False)
    choice = [dict({k: e[k] for k in keys}, split="fit", timing="eager", chosen=e["method"], chosen_ms=e["ms"])
              for e in entries]
    choice += held[keys + ["timing", "chosen", "chosen_ms", "regret", "speedup_vs_best_library"]].assign(
        split="held_out").to_dict("records") if len(held) else []
    pd.DataFrame(choice).to_csv(out / f"variant_choice{suffix}.csv", index=False)
    for line in summary_lines(held, study.name, list(study.match_keys)):
        print(line, flush=True)
    written = ["auto_table.json", f"held_out{suffix}.csv", f"variant_choice{suffix}.csv"] + tables
    if study.features is not None:
        written += model_and_scores(study, bench, out, configs, entries, suffix=suffix, source=source,
                                    splits=model_splits)
    return written


# --------------------------------------------------------------------------
# The choice model: fitted on the fit half, scored on the held-out half and on random shapes
# --------------------------------------------------------------------------
def with_features(rows, study: Study):
    """``rows`` (rank 0's, status ok) with the choice model's features of each row's case."""
    rows = rows[rows["status"] == "ok"]
    rows = rows[rows["rank"] == 0] if "rank" in rows else rows
    feats = [study.features(dict(zip(study.keys, k))) for k in rows[list(study.keys)].itertuples(index=False)]
    return rows.assign(**{f: [x[f] for x in feats] for f in ("flop", "gemm_bytes", "comm_bytes")})


def fit_model(study: Study, bench, configs: dict, source: str, splits: tuple = ("fit",)) -> dict:
    """The choice model (``kernels.comm.choice_model``) fitted on the rows of ``splits`` only (the
    fit half; with "random", also the shapes that run drew, which then score nothing)."""
    from kernels.comm import choice_model

    rows = with_features(bench[bench["split"].isin(splits)], study)
    have = set(rows["variant"])
    candidates = {m: _launch_config(configs.get(m, {"variant": m})) for m in study.choices if m in have}
    return choice_model.fit(rows, group_keys=list(study.match_keys), gemm=study.gemm, comm=study.comm,
                            candidates=candidates, family=study.family,
                            source=source + " (" + " + ".join(FIT_SPLITS.get(s, s) for s in splits) + ")",
                            never=study.never)


def _launch_config(cfg: dict) -> dict:
    """A benchmark row's config as the launcher takes it (test-only and deprecated knobs dropped)."""
    return {k: v for k, v in dict(cfg).items() if k not in ("skip_rank", "max_spins") and v is not None}


def model_pick(study: Study, model: dict) -> Callable[[dict, str], str | None]:
    """The model's choice for a case in a timing mode (what ``auto_config`` does for the mode served,
    the family's rule of methods never taken applied as the launcher applies it: also to a model
    fitted before a method joined the rule)."""
    from kernels.comm import choice_model

    def pick(case, timing):
        match = {k: int(case[k]) for k in study.match_keys}
        never = set(study.never(match)) if study.never else set()
        return choice_model.choose(model, timing, study.features(case), exclude=never, **match)
    return pick


FIT_SPLITS = {"fit": "fit half", "random": "the shapes drawn at run time"}
AUTO = "auto"   # the benchmarks' name of the launcher's own choice (config=None), timed beside the candidates
# how choice_scores*.csv's rules read in the summaries
RULES = {"model": "choice model", "nearest": "nearest entry", "measured": "as the launcher chose, measured"}


def model_and_scores(study: Study, bench, out: Path, configs: dict, entries: list[dict], *, suffix: str = "",
                     source: str = "", splits: tuple = ("fit",)) -> list[str]:
    """Fit the choice model (``choice_model.json``, and ``tables/<GPU>/<family>.model.json`` beside
    the tuning table), then score it and the nearest-entry rule on the held-out half and on the
    shapes drawn at run time (``choice_scores{suffix}.csv``, column ``rule``); prints the lines."""
    import pandas as pd

    from kernels.comm import choice_model, choices

    model = fit_model(study, bench, configs, source, splits)
    choice_model.save(out / "choice_model.json", model)
    written = ["choice_model.json"]
    device = choices.device_of_rows(bench)
    if device is not None:
        path = choice_model.save(choice_model.path_for(out / "tables", device, study.family), model)
        written.append(str(path.relative_to(out)))
    frames = []
    rules = [("model", model_pick(study, model)), ("nearest", None)]
    if AUTO in set(bench["variant"]):   # the launcher's own choice as it ran (the model shipped then)
        rules.append(("measured", lambda case, timing: AUTO))
    for split in ("held_out", "random"):
        for rule, pick in rules:
            if rule == "model" and split in splits:   # fitted on these shapes: no score
                continue
            scored = score_held_out(bench, entries, list(study.keys), list(study.match_keys), study.choices,
                                    study.libraries, study.gemm, study.comm, fused=study.fused, pick=pick, split=split,
                                    keep_failed=rule == "measured")
            if len(scored):
                frames.append(scored.assign(split=split, rule=rule))
    scores = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    scores.to_csv(out / f"choice_scores{suffix}.csv", index=False)
    for (split, rule), g in scores.groupby(["split", "rule"]) if len(scores) else ():
        if (split, rule) == ("held_out", "nearest"):   # the lines above, already printed
            continue
        name = f"{study.name} [{split}, {RULES[rule]}]"
        for line in summary_lines(g, name, list(study.match_keys)):
            print(line, flush=True)
    return written + [f"choice_scores{suffix}.csv"]
