"""An autotuner that picks among the grouped GEMM backends per layer.

Backends (each computes fwd, dgrad or wgrad from ``(a, b, group_sizes)``):

* ``triton``: ours (``kernels.moe.grouped_gemm`` / ``grouped_gemm_wgrad``), group
  sizes stay on the GPU;
* ``grouped_mm`` and ``cublas_loop``: the library baselines of
  ``kernels.moe.baselines`` (``torch._grouped_mm``; one ``torch.mm`` per expert).

Operations, with the layer's weight ``w`` of shape ``[G, K, N]``:

* ``fwd``:   ``a = x [M, K]``,  ``b = w``  -> ``[M, N]``
* ``dgrad``: ``a = dy [M, N]``, ``b = w``  -> ``dx [M, K]`` (``dy @ w[g].T``)
* ``wgrad``: ``a = x [M, K]``,  ``b = dy [M, N]`` -> ``dw [G, K, N]``

The autotuner times the backends once per key ``(op, G, N, K, dtype, device)``
(the layer's N and K; the token count and its split across experts are left
out, so dynamic routing never retunes) and keeps the choices in a tuning table of
the selection layer (``kernels.common.tables``: plain JSON per device model,
compute capability and Triton version, read bounded, written merged and
atomically), family ``grouped_backend``, beside the ``grouped`` table that
``grouped_gemm`` itself consults: ``$WORKBENCH_TUNING_DIR/<device>/grouped_backend.json``
(default ``~/.cache/kernel-workbench/tuning``), or the file
``$WORKBENCH_GROUPED_GEMM_CACHE`` / ``cache_path`` names. Its ``triton`` backend is
``grouped_gemm`` as a user calls it, so whatever that table says for the call (one of
our kernels, or ``torch._grouped_mm``) is what "ours" runs. The two tables stay
apart because their keys and backends differ: a backend choice may name the
per-expert cuBLAS loop, which needs the group sizes on the host (so
``grouped_gemm``, which never reads them there, cannot run it), and may key on a
routing class computed from those host sizes.

Because one key serves every token count, the tuner times the backends at the
caller's count and at ``probe_scales`` times it (default: twice it, the same
routing proportions) and keeps a backend that is good at all of them: the
first in ``BACKENDS`` order within ``margin`` of the fastest at every probed
count (so the choice does not flip on noise), else the one whose worst ratio to
the fastest is highest. A table file that is corrupt, too large, or made
on another device or Triton version is ignored with one warning and replaced at the
next save; a backend that fails is skipped.
"""
from __future__ import annotations

import math
import os
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from kernels.common import select as common_select
from kernels.common import tables
from kernels.moe.baselines import BackendUnavailable, cublas_loop, grouped_mm, grouped_mm_offsets
from kernels.moe.config import OPS
from kernels.moe.launch import grouped_gemm, grouped_gemm_wgrad
from workbench import bench

__all__ = [
    "BACKENDS",
    "OPS",
    "BackendUnavailable",
    "GroupedGemmAutotuner",
    "autotuned",
    "default_cache_path",
    "routing_bucket",
    "run_backend",
    "scale_tokens",
]

BACKENDS = ("triton", "grouped_mm", "cublas_loop")   # preference order on ties
TABLE_FAMILY = "grouped_backend"   # its tables' name in the selection layer's directory


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")


def _triton(op, a, b, group_sizes, **_):
    if op == "fwd":
        return grouped_gemm(a, b, group_sizes)
    if op == "dgrad":
        return grouped_gemm(a, b, group_sizes, trans_w=True)
    return grouped_gemm_wgrad(a, b, group_sizes)


_IMPLS: dict[str, Callable] = {"triton": _triton, "grouped_mm": grouped_mm, "cublas_loop": cublas_loop}


def run_backend(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor,
                **kwargs) -> torch.Tensor:
    """Run one backend. kwargs: `offs` (grouped_mm), `host_sizes` (cublas_loop)."""
    _check_op(op)
    if name not in _IMPLS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return _IMPLS[name](op, a, b, group_sizes, **kwargs)


# ---------------------------------------------------------------------------
# Routing classes
# ---------------------------------------------------------------------------


def routing_bucket(host_sizes) -> str:
    """A coarse class of a routing, from sizes already on the host: the largest
    group over the mean. 'even' (< 1.15), 'mild' (< 2), 'skewed' (< 3.5) or
    'concentrated'. The seed's mildly unbalanced routing (largest group 1.35-1.6x
    the mean on its shapes) is its own class: on the H200 the fastest backend
    already changes between balanced and mild routing on gpt-oss-20B with 4
    experts (results/grouped_gemm)."""
    sizes = [int(v) for v in host_sizes]
    total = sum(sizes)
    if not sizes or total == 0:
        return "even"
    ratio = max(sizes) * len(sizes) / total
    for name, below in (("even", 1.15), ("mild", 2.0), ("skewed", 3.5)):
        if ratio < below:
            return name
    return "concentrated"


def scale_tokens(scale: float, op: str, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor,
                 kwargs: dict):
    """(a, b, group_sizes, kwargs) with every group's token count times `scale`
    (floored): the same layer and routing proportions at another count, for the
    autotuner's probes. Token rows (a; b too for wgrad) are reused cyclically.
    Reads the sizes on the host (one sync, at tuning time only). None when the
    inputs do not fit in device memory."""
    if scale == 1.0:
        return a, b, group_sizes, kwargs
    host = kwargs.get("host_sizes")
    base = [int(v) for v in (host if host is not None else group_sizes.tolist())]
    sizes = [int(v * scale) for v in base]
    total = sum(sizes)

    def rows(t: torch.Tensor) -> torch.Tensor:
        if total <= t.shape[0]:
            return t[:total]
        reps = -(-total // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:total]

    try:
        a2 = rows(a)
        b2 = rows(b) if op == "wgrad" else b
    except torch.cuda.OutOfMemoryError:
        warnings.warn(f"grouped GEMM autotune: inputs at {scale:g}x the token count do not fit in memory; "
                      f"tuning at the caller's count only", RuntimeWarning, stacklevel=3)
        return None
    s2 = torch.tensor(sizes, dtype=group_sizes.dtype, device=group_sizes.device)
    kw = dict(kwargs)
    if kw.get("host_sizes") is not None:
        kw["host_sizes"] = sizes
    if kw.get("offs") is not None:
        kw["offs"] = grouped_mm_offsets(s2)
    return a2, b2, s2, kw


# ---------------------------------------------------------------------------
# Autotuner
# ---------------------------------------------------------------------------


def default_cache_path(device: dict[str, str] | None = None) -> Path:
    """The table file the autotuner keeps its choices in for ``device`` ({'name', 'capability'},
    default this process's first CUDA GPU, else the interpreter's):
    ``$WORKBENCH_GROUPED_GEMM_CACHE`` if set, else ``grouped_backend.json`` in that device's
    directory of the user's tuning tables (``$WORKBENCH_TUNING_DIR``, default
    ``~/.cache/kernel-workbench/tuning``)."""
    env = os.environ.get("WORKBENCH_GROUPED_GEMM_CACHE")
    if env:
        return Path(env).expanduser()
    if device is None:
        device = common_select.device_of(torch.cuda.current_device() if torch.cuda.is_available() else None)
    return tables.table_path(tables.user_root(), device, TABLE_FAMILY)


def _device_of(t: torch.Tensor) -> dict[str, str]:
    if t.device.type == "cuda":
        return common_select.device_of(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return common_select.device_of(None)


def _device_name(t: torch.Tensor) -> str:
    if t.device.type == "cuda":
        return torch.cuda.get_device_name(t.device).replace(" ", "_")
    return t.device.type


class GroupedGemmAutotuner:
    """Picks a backend per (op, G, N, K, dtype, device), good at the caller's token
    count and at `probe_scales` times it, and remembers it on disk."""

    def __init__(self, cache_path: str | os.PathLike | None = None, *,
                 backends: tuple[str, ...] = BACKENDS, margin: float = 0.015, rounds: int = 3,
                 timer: Callable[[Callable[[], object]], float] | None = None,
                 warmup_ms: float = 50.0, rep_ms: float = 150.0, probe_scales: tuple[float, ...] = (2.0,)):
        for b in backends:
            if b not in _IMPLS:
                raise ValueError(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
        # An explicit file (one device's table), else each device's file under the user's tables.
        self._explicit = Path(cache_path).expanduser() if cache_path is not None else None
        if self._explicit is None and os.environ.get("WORKBENCH_GROUPED_GEMM_CACHE"):
            self._explicit = default_cache_path()
        self.backends = tuple(backends)
        # 1.5%: a backend this close to the fastest at every probed count is a tie,
        # and ties go to the earlier backend (ours first), so noise cannot flip it.
        self.margin = float(margin)
        # Token-count multiples timed besides the caller's own count. Twice it by
        # default: a grouped kernel's lead over per-expert GEMMs shrinks as experts
        # get more tokens (H200, gpt-oss-20B GateUP dgrad, 4 experts, mild routing:
        # ours 1.5% ahead of the cuBLAS loop at 2048 tokens per expert, 2.1% behind
        # at 4096; results/grouped_gemm), so a larger count is what can overturn it.
        scales = tuple(float(x) for x in probe_scales)
        if any(not x > 0 or x == 1.0 for x in scales):
            raise ValueError(f"probe_scales are token-count multiples other than 1 (the caller's count is "
                             f"always timed), got {probe_scales!r}")
        self.probe_scales = scales
        self.rounds = max(1, int(rounds))
        self._timer = timer
        self.warmup_ms, self.rep_ms = float(warmup_ms), float(rep_ms)
        self.entries: dict[str, dict] = {}   # key -> entry, of every table read (on first use) or written
        self._read: set[Path] = set()
        self.tunings = 0          # how many keys this instance timed (tests read it)

    @property
    def cache_path(self) -> Path:
        """The table file of this process's device (or the explicit one)."""
        return self._explicit if self._explicit is not None else default_cache_path()

    def _path(self, device: dict[str, str]) -> Path:
        return self._explicit if self._explicit is not None else default_cache_path(device)

    # -- persistence: a selection-layer tuning table -------------------------------
    def _load(self, device: dict[str, str]) -> None:
        """Read a device's table once (bounded; a bad file, or one made on another device or
        Triton version, is ignored with one warning)."""
        path = self._path(device)
        if path in self._read:
            return
        self._read.add(path)
        head = tables.header(device, TABLE_FAMILY)
        entries = tables.read(path, {k: head[k] for k in ("device", "capability", "triton", "family")})
        self.entries.update({k: v for k, v in entries.items() if v.get("backend") in _IMPLS})

    def _save(self, key: str, entry: dict, device: dict[str, str]) -> None:
        path = self._path(device)
        try:
            tables.write_entry(path, tables.header(device, TABLE_FAMILY), key, entry)
        except OSError as exc:
            warnings.warn(f"cannot write grouped GEMM autotune table {path} ({exc}); "
                          f"choices stay in memory", RuntimeWarning, stacklevel=3)

    # -- keys and choices ----------------------------------------------------------
    @staticmethod
    def key(op: str, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, host_sizes=None) -> str:
        """(op, G, N, K, dtype, device): the layer's N and K, never the token counts.

        Which backend wins depends on how the tokens are spread (a per-expert
        cuBLAS loop wins when a few experts take everything; grouped kernels win
        when many experts get a little each), and that is not known on the host
        without a sync. When the caller already has the sizes on the host
        (`host_sizes`, e.g. the split sizes an expert-parallel all-to-all needs
        anyway) the key gains a coarse routing class (see `routing_bucket`): at
        most three tunings per layer, never one per step."""
        _check_op(op)
        G = int(group_sizes.shape[0])
        if op == "fwd":
            K, N = int(b.shape[1]), int(b.shape[2])
        elif op == "dgrad":
            K, N = int(b.shape[1]), int(b.shape[2])
        else:
            K, N = int(a.shape[1]), int(b.shape[1])
        dtype = str(a.dtype).replace("torch.", "")
        key = f"{op}|G={G}|N={N}|K={K}|{dtype}|{_device_name(a)}"
        if host_sizes is not None:
            key += f"|{routing_bucket(host_sizes)}"
        return key

    def _decide(self, probes: list[dict[str, float]]) -> str:
        """The backend for timings at one or more token counts (name -> ms, inf
        when it failed): the first in the fixed order within `margin` of the
        fastest at every count, else the one whose worst ratio to the fastest is
        highest. A count at which nothing ran says nothing."""
        worst: dict[str, float] = {}
        for times in probes:
            finite = [v for v in times.values() if math.isfinite(v)]
            if not finite:
                continue
            for name in self.backends:
                t = times.get(name, math.inf)
                ratio = min(finite) / t if math.isfinite(t) else 0.0
                worst[name] = min(worst.get(name, 1.0), ratio)
        live = {n: w for n, w in worst.items() if w > 0}
        if not live:
            return "triton"
        for name in self.backends:          # fixed order: ties go to the earlier backend
            if live.get(name, 0.0) >= 1.0 / (1.0 + self.margin):
                return name
        return max(live, key=lambda n: (live[n], -self.backends.index(n)))

    def tune(self, op: str, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, **kwargs) -> str:
        """Time every backend at the caller's token count and at each of
        `probe_scales` times it, and remember the choice (see `_decide`).

        On a GPU the backends take turns run by run (``workbench.bench.interleave``:
        warm-up, then at least 15 flushed runs each): the H200's clocks drift with
        power by several per cent within seconds, and a short measurement taken
        one backend after another picked the wrong backend by up to 12% in an
        earlier run (results/grouped_gemm). With a custom ``timer`` (tests) each
        backend is timed in ``rounds`` rotating rounds and the median kept."""
        errors: dict[str, str] = {}
        probes = []
        for scale in (1.0,) + self.probe_scales:
            scaled = scale_tokens(scale, op, a, b, group_sizes, kwargs)
            if scaled is None:
                errors[f"x{scale:g}"] = "inputs at this token count do not fit in memory; not probed"
                continue
            tag = "" if scale == 1.0 else f"@x{scale:g}"
            times = self._time_backends(op, *scaled, errors=errors, tag=tag)
            probes.append({"scale": scale, "tokens": int(scaled[0].shape[0]), "times_ms": times})
            del scaled
        choice = self._decide([p["times_ms"] for p in probes])

        def jsonable(times):
            return {k: (v if math.isfinite(v) else None) for k, v in times.items()}

        key = self.key(op, a, b, group_sizes, kwargs.get("host_sizes"))
        first = probes[0]["times_ms"] if probes else {}
        entry = {
            # the selection layer's entry fields (a backend has no knobs), then the autotuner's
            "candidate": choice, "variant": "backend", "config": {},
            "backend": choice,
            "times_ms": jsonable(first),
            "probes": [{"tokens": p["tokens"], "times_ms": jsonable(p["times_ms"])} for p in probes[1:]],
            "errors": errors,
            "tuned_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "tuned_tokens": int(a.shape[0]),
            "how": "custom timer" if self._timer is not None else "eager, backends in turn, L2 flushed, median",
            "by": "GroupedGemmAutotuner",
        }
        if math.isfinite(first.get(choice, math.inf)):
            entry["us"] = round(first[choice] * 1e3, 3)
        self.entries[key] = entry
        self.tunings += 1
        self._save(key, entry, _device_of(a))
        return choice

    def _time_backends(self, op, a, b, group_sizes, kwargs, *, errors: dict, tag: str) -> dict[str, float]:
        """name -> median ms (inf when it failed; the reason goes to errors[name + tag])."""
        fns = {name: (lambda n=name: run_backend(n, op, a, b, group_sizes, **kwargs)) for name in self.backends}
        if self._timer is None:
            timings = bench.interleave(fns, warmup_ms=self.warmup_ms, rep_ms=self.rep_ms)
            for n in fns:
                if n not in timings:
                    errors[n + tag] = "failed in its first call (see run_backend for the reason)"
            return {n: (timings[n].median_ms if n in timings else math.inf) for n in fns}
        local: dict[str, str] = {}
        times = self._time_with(self._timer, fns, local)
        errors.update({n + tag: e for n, e in local.items()})
        return times

    def _time_with(self, timer, fns: dict, errors: dict) -> dict[str, float]:
        samples: dict[str, list[float]] = {}
        for name, fn in fns.items():
            try:
                fn()                                   # warm-up / compile
                samples[name] = []
            except Exception as exc:  # BackendUnavailable, or anything else: skip it
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
        live = list(samples)
        for r in range(self.rounds if live else 0):
            for name in live[r % len(live):] + live[:r % len(live)]:
                if name in errors:
                    continue
                try:
                    samples[name].append(float(timer(fns[name])))
                except Exception as exc:
                    errors[name] = f"{type(exc).__name__}: {exc}"[:300]
        times = {n: (sorted(v)[len(v) // 2] if v and n not in errors else math.inf) for n, v in samples.items()}
        times.update({n: math.inf for n in errors})
        return times

    def choose(self, op: str, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, **kwargs) -> str:
        self._load(_device_of(a))
        entry = self.entries.get(self.key(op, a, b, group_sizes, kwargs.get("host_sizes")))
        if entry is not None and entry.get("backend") in self.backends:
            return entry["backend"]
        return self.tune(op, a, b, group_sizes, **kwargs)

    def __call__(self, op: str, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor,
                 **kwargs) -> torch.Tensor:
        name = self.choose(op, a, b, group_sizes, **kwargs)
        try:
            return run_backend(name, op, a, b, group_sizes, **kwargs)
        except BackendUnavailable as exc:
            if name == "triton":
                raise
            warnings.warn(f"grouped GEMM backend {name} failed ({exc}); using triton", RuntimeWarning,
                          stacklevel=2)
            return run_backend("triton", op, a, b, group_sizes)


_DEFAULT_TUNER: GroupedGemmAutotuner | None = None


def autotuned(op: str, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, **kwargs) -> torch.Tensor:
    """fwd/dgrad/wgrad through the process-wide autotuner (default cache path)."""
    global _DEFAULT_TUNER
    if _DEFAULT_TUNER is None:
        _DEFAULT_TUNER = GroupedGemmAutotuner()
    return _DEFAULT_TUNER(op, a, b, group_sizes, **kwargs)
