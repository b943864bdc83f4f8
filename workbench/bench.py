"""Timing a callable on the GPU, with the statistics a kernel study reports.

    from workbench.bench import measure
    t = measure(lambda: matmul(a, b), warmup_ms=25, rep_ms=100)
    print(t, t.tflops(2 * M * N * K))

On a CUDA device (and not under ``TRITON_INTERPRET=1``) every run is timed
with its own pair of CUDA events (``torch.cuda.Event``) after a warm-up; the
L2 cache is flushed before each run by default (Triton's benchmark buffer,
``triton.runtime.driver.active.get_empty_cache_for_benchmark``), so a kernel
whose inputs fit in the 60 MB L2 of an H200 is not timed on a hot cache.
``cuda_graph=True`` captures the call in a CUDA graph and times its replays,
which removes launch gaps for short or many-kernel calls. ``input_sets``
rotates among several input sets (``fn`` then takes one set); use
``sets_for_l2`` to pick how many, when you time without a flush.

Two modes, named in every result (``Timing.mode``): ``eager`` times each call
between CUDA events as a user's Python loop gets it, host cost included (a
launcher that spends 100 us on the host before its kernel starts shows it);
``graph`` captures the call in a CUDA graph and times replays: GPU time alone.
Every eager measurement also records the host time per call (``host_us``:
the median wall time of the Python call itself, without synchronizing), and
``host_time_us`` measures only that, over many back-to-back calls.

``interleave`` compares several callables run by run in turn (the order
rotating each round): on a power-limited card whose clocks drift by several
per cent within seconds, timing one variant after another favours whichever
ran on the cooler card.

Without a GPU (or in the interpreter) the same call runs on the host timer and
the result says so: ``Timing.is_performance`` is False, ``str(timing)`` ends
with ``[not performance]``, and plots should label such numbers.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Sequence

__all__ = ["Timing", "measure", "interleave", "host_time_us", "sets_for_l2", "l2_bytes", "gpu_timing_available",
           "MODES", "rep_counts"]

MODES = ("eager", "graph")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Statistics of one measurement (all times in milliseconds per call)."""

    median_ms: float
    q25_ms: float
    q75_ms: float
    n: int  # timed runs (samples)
    is_performance: bool  # False: host timer / interpreter, not a GPU measurement
    min_ms: float = math.nan
    mean_ms: float = math.nan
    method: str = ""  # "cuda-events", "cuda-graph", "cuda-graph-unrolled", "host-timer"
    l2_flushed: bool = False
    input_sets: int = 1
    calls_per_sample: int = 1
    device: str = ""
    mode: str = "eager"  # "eager" (host cost included) or "graph" (CUDA-graph replays: GPU time alone)
    host_us: float = math.nan  # median host wall time of one call (eager runs), microseconds
    times_ms: tuple = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def iqr_ms(self) -> float:
        return self.q75_ms - self.q25_ms

    @property
    def rel_spread(self) -> float:
        """Interquartile range over the median: the noise to compare differences against."""
        return self.iqr_ms / self.median_ms if self.median_ms > 0 else math.nan

    def tflops(self, flops: float) -> float:
        """TFLOP/s at the median time."""
        return flops / (self.median_ms * 1e-3) / 1e12 if self.median_ms > 0 else math.nan

    def gbps(self, nbytes: float) -> float:
        """GB/s (1e9 bytes per second) at the median time."""
        return nbytes / (self.median_ms * 1e-3) / 1e9 if self.median_ms > 0 else math.nan

    def fraction_of_ceiling(self, *, flops: float | None = None, nbytes: float | None = None,
                            peak_tflops: float | None = None, peak_gbps: float | None = None) -> float:
        """Floor time over measured time: 1.0 means the roofline bound is reached.

        The floor is the larger of ``flops / peak_tflops`` and ``nbytes / peak_gbps``
        (whichever of the two pairs is given).
        """
        floors = []
        if flops is not None and peak_tflops:
            floors.append(flops / (peak_tflops * 1e12))
        if nbytes is not None and peak_gbps:
            floors.append(nbytes / (peak_gbps * 1e9))
        if not floors or self.median_ms <= 0:
            return math.nan
        return max(floors) / (self.median_ms * 1e-3)

    def as_row(self, prefix: str = "") -> dict[str, Any]:
        """Flat fields for a results table."""
        return {f"{prefix}{k}": v for k, v in (
            ("median_ms", self.median_ms), ("q25_ms", self.q25_ms), ("q75_ms", self.q75_ms),
            ("min_ms", self.min_ms), ("mean_ms", self.mean_ms), ("n_runs", self.n),
            ("is_performance", self.is_performance), ("timing_method", self.method),
            ("l2_flushed", self.l2_flushed), ("input_sets", self.input_sets), ("mode", self.mode),
            ("host_us", self.host_us))}

    def __str__(self) -> str:
        host = f", host {self.host_us:.1f} us/call" if not math.isnan(self.host_us) else ""
        s = (f"{self.median_ms:.4f} ms (IQR {self.q25_ms:.4f}-{self.q75_ms:.4f}, n={self.n}, {self.mode}, "
             f"{self.method}{', L2 flushed' if self.l2_flushed else ''}{host})")
        return s if self.is_performance else s + " [not performance]"


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    n = len(sorted_values)
    if n == 1:
        return float(sorted_values[0])
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def _summarize(times: Sequence[float], **fields) -> Timing:
    s = sorted(times)
    return Timing(median_ms=float(statistics.median(s)), q25_ms=_quantile(s, 0.25), q75_ms=_quantile(s, 0.75),
                  n=len(s), min_ms=float(s[0]), mean_ms=float(statistics.fmean(s)), times_ms=tuple(s), **fields)


def gpu_timing_available() -> bool:
    """True when calls can be timed with CUDA events (a GPU, no interpreter)."""
    from kernels.common.interpreter import active

    if active():
        return False
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


def l2_bytes(device: int | None = None) -> int:
    """L2 size of the current CUDA device (0 without one)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    return int(getattr(props, "L2_cache_size", 0) or 0)


def sets_for_l2(bytes_per_set: int, l2: int | None = None, *, max_sets: int = 64) -> int:
    """How many input sets to rotate so that consecutive runs miss L2.

    One set when a set is already at least twice the L2; otherwise enough sets
    to cover three times the L2 (at most ``max_sets``).
    """
    l2 = l2_bytes() if l2 is None else l2
    if l2 <= 0 or bytes_per_set <= 0 or bytes_per_set >= 2 * l2:
        return 1
    return max(1, min(max_sets, math.ceil(3 * l2 / bytes_per_set)))


_FLUSH: dict[int, Any] = {}


def _flush_buffer(device_index: int):
    """Triton's L2-flush buffer (256 MB), one per device, reused."""
    buf = _FLUSH.get(device_index)
    if buf is None:
        import triton

        buf = triton.runtime.driver.active.get_empty_cache_for_benchmark()
        _FLUSH[device_index] = buf
    return buf


def rep_counts(estimate_ms: float, warmup_ms: float, rep_ms: float, min_reps: int, max_reps: int) -> tuple[int, int]:
    est = max(estimate_ms, 1e-4)
    n_warm = max(0, min(max_reps, int(warmup_ms / est)))
    n_rep = max(min_reps, min(max_reps, int(rep_ms / est)))
    return n_warm, n_rep


def _graph_mode(mode: str | None, cuda_graph: bool) -> bool:
    if mode is None:
        return bool(cuda_graph)
    if mode not in MODES:
        raise ValueError(f"bench: mode={mode!r} must be one of {MODES} (eager: as a user's loop calls it; "
                         f"graph: CUDA-graph replays, GPU time alone)")
    return mode == "graph"


def measure(fn: Callable, *, warmup_ms: float = 25, rep_ms: float = 100, flush_l2: bool = True,
            mode: str | None = None, cuda_graph: bool = False, input_sets: Sequence[Any] | None = None,
            min_reps: int | None = None, max_reps: int = 10000) -> Timing:
    """Time ``fn`` and return the median, quartiles and number of runs.

    fn: a callable taking no argument, or one input set when ``input_sets`` is
        given (the harness passes ``input_sets[i % len(input_sets)]`` to run i).
    warmup_ms / rep_ms: time budgets for warm-up and timed runs; the number of
        runs comes from a first estimate (at least ``min_reps``: 5 on a GPU, 1
        on the host timer).
    flush_l2: clear the L2 before each timed run (GPU only).
    mode: "eager" (default) or "graph": time graph replays. With ``flush_l2``
        each sample is one replayed call after a flush; without it a graph of
        several unrolled calls is replayed and each sample is its time divided
        by the calls. ``cuda_graph=True`` is the older spelling of "graph".
    """
    cuda_graph = _graph_mode(mode, cuda_graph)
    sets = None
    if input_sets is not None:
        sets = list(input_sets)
        if not sets:
            raise ValueError("measure: input_sets is empty")

        def call(i: int):
            return fn(sets[i % len(sets)])
    else:
        def call(i: int):
            return fn()

    n_sets = len(sets) if sets else 1
    if not gpu_timing_available():
        return _measure_host(call, warmup_ms, rep_ms, 1 if min_reps is None else min_reps, max_reps, n_sets)
    if cuda_graph:
        return _measure_graph(call, warmup_ms, rep_ms, flush_l2, 5 if min_reps is None else min_reps,
                              max_reps, n_sets)
    return _measure_events(call, warmup_ms, rep_ms, flush_l2, 5 if min_reps is None else min_reps, max_reps, n_sets)


def _measure_host(call, warmup_ms, rep_ms, min_reps, max_reps, n_sets) -> Timing:
    t0 = time.perf_counter()
    call(0)  # compile / first-touch
    first = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    call(1)
    est = (time.perf_counter() - t0) * 1e3 or first
    n_warm, n_rep = rep_counts(est, warmup_ms, rep_ms, min_reps, max_reps)
    for i in range(n_warm):
        call(i)
    times = []
    for i in range(n_rep):
        t0 = time.perf_counter()
        call(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return _summarize(times, is_performance=False, method="host-timer", l2_flushed=False,
                      input_sets=n_sets, device="cpu", host_us=statistics.median(times) * 1e3)


def _measure_events(call, warmup_ms, rep_ms, flush_l2, min_reps, max_reps, n_sets) -> Timing:
    import torch
    import triton

    dev = torch.cuda.current_device()
    clear = triton.runtime.driver.active.clear_cache
    cache = _flush_buffer(dev) if flush_l2 else None

    def flush():
        if cache is not None:
            clear(cache)

    call(0)
    torch.cuda.synchronize()
    # Estimate: five runs, each between its own events.
    est_events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)]
    for i, (s, e) in enumerate(est_events):
        flush()
        s.record()
        call(i)
        e.record()
    torch.cuda.synchronize()
    est = statistics.median(s.elapsed_time(e) for s, e in est_events)
    n_warm, n_rep = rep_counts(est, warmup_ms, rep_ms, min_reps, max_reps)
    for i in range(n_warm):
        call(i)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_rep)]
    host = []
    for i, (s, e) in enumerate(events):
        flush()
        s.record()
        t0 = time.perf_counter()
        call(i)
        host.append(time.perf_counter() - t0)
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events]
    return _summarize(times, is_performance=True, method="cuda-events", l2_flushed=flush_l2,
                      input_sets=n_sets, device=torch.cuda.get_device_name(dev),
                      host_us=statistics.median(host) * 1e6)


def _measure_graph(call, warmup_ms, rep_ms, flush_l2, min_reps, max_reps, n_sets) -> Timing:
    import torch
    import triton

    dev = torch.cuda.current_device()
    name = torch.cuda.get_device_name(dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(max(2, n_sets)):  # compile and warm every set outside the capture
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    if flush_l2:
        # One graph per input set, one call each; flush before every replay.
        graphs = []
        for i in range(n_sets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call(i)
            graphs.append(g)
        clear = triton.runtime.driver.active.clear_cache
        cache = _flush_buffer(dev)

        def sample(events):
            for i, (s, e) in enumerate(events):
                clear(cache)
                s.record()
                graphs[i % n_sets].replay()
                e.record()
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in events]

        est = statistics.median(sample([(torch.cuda.Event(enable_timing=True),
                                         torch.cuda.Event(enable_timing=True)) for _ in range(5)]))
        n_warm, n_rep = rep_counts(est, warmup_ms, rep_ms, min_reps, max_reps)
        for i in range(n_warm):
            graphs[i % n_sets].replay()
        times = sample([(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range(n_rep)])
        return _summarize(times, is_performance=True, method="cuda-graph", l2_flushed=True,
                          input_sets=n_sets, device=name, mode="graph")

    # No flush: unroll enough calls into one graph that a replay lasts ~1 ms+.
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for i in range(5):
        call(i)
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e) / 5, 1e-4)
    unroll = max(1, min(1000, math.ceil(1.0 / est)))
    unroll = math.ceil(unroll / n_sets) * n_sets  # every set equally often
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(unroll):
            call(i)
    torch.cuda.synchronize()
    n_warm, n_rep = rep_counts(est * unroll, warmup_ms, rep_ms, min_reps, max_reps)
    for _ in range(n_warm):
        g.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_rep)]
    for s, e in events:
        s.record()
        g.replay()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / unroll for s, e in events]
    return _summarize(times, is_performance=True, method="cuda-graph-unrolled", l2_flushed=False,
                      input_sets=n_sets, calls_per_sample=unroll, device=name, mode="graph")


def capture(fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """A CUDA graph of one call of ``fn``, warmed up on a side stream first (as capture needs):
    (its replay, the captured call's result, which every replay rewrites)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g.replay, out


def interleave(fns: dict[str, Callable[[], Any]], *, warmup_ms: float = 50, rep_ms: float = 100,
               min_reps: int = 15, max_reps: int = 200, flush_l2: bool = True,
               mode: str = "eager") -> dict[str, Timing]:
    """Time several callables run by run in turn; one ``Timing`` per name.

    Every round runs each callable once, each between its own CUDA events after
    an L2 flush, and the first callable of a round rotates. The number of
    rounds gives each callable about ``rep_ms`` of timed runs (``min_reps`` to
    ``max_reps``), after about ``warmup_ms`` of warm-up each, which also lets
    the clocks settle after whatever ran before. ``mode="graph"`` captures each
    callable in a CUDA graph first and times its replays (GPU time alone);
    ``"eager"`` times the calls themselves and records their host time. A
    callable that raises in its first call (or capture) is left out of the
    result (the others are still timed); one that raises later propagates. On
    the host timer the same rotation runs and the results say
    ``is_performance=False``.
    """
    graph = _graph_mode(mode, False)
    on_gpu = gpu_timing_available()
    live: dict[str, Callable[[], Any]] = {}
    for name, fn in fns.items():
        try:
            fn()
            live[name] = capture(fn)[0] if graph and on_gpu else fn
        except Exception:
            continue
    if not live:
        return {}
    if on_gpu:
        import torch
        import triton

        dev = torch.cuda.current_device()
        cache = _flush_buffer(dev) if flush_l2 else None
        clear = triton.runtime.driver.active.clear_cache

        def timed_round(order):
            pairs = []
            for name in order:
                if cache is not None:
                    clear(cache)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                t0 = time.perf_counter()
                live[name]()
                host = time.perf_counter() - t0
                e.record()
                pairs.append((name, s, e, host))
            return pairs

        def finish(pairs):
            torch.cuda.synchronize()
            return [(name, s.elapsed_time(e), host) for name, s, e, host in pairs]
    else:
        def timed_round(order):
            out = []
            for name in order:
                t0 = time.perf_counter()
                live[name]()
                dt = time.perf_counter() - t0
                out.append((name, dt * 1e3, dt))
            return out

        def finish(pairs):
            return pairs

    names = list(live)
    # Estimate one round, then size warm-up and timing from it.
    est = {n: t for n, t, _ in finish(timed_round(names))}
    slowest = max(max(est.values()), 1e-4)
    n_warm = max(1, min(max_reps, int(warmup_ms / slowest)))
    n_rep = max(min_reps, min(max_reps, int(rep_ms / slowest)))
    for i in range(n_warm):  # same rotation, results dropped
        timed_round(names[i % len(names):] + names[:i % len(names)])
    samples: dict[str, list[float]] = {n: [] for n in names}
    hosts: dict[str, list[float]] = {n: [] for n in names}
    pairs = []
    for i in range(n_rep):
        k = i % len(names)
        pairs.extend(timed_round(names[k:] + names[:k]))
    for name, ms, host in finish(pairs):
        samples[name].append(ms)
        hosts[name].append(host)
    device = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
    graphed = graph and on_gpu
    method = ("cuda-graph-interleaved" if graphed else "cuda-events-interleaved") if on_gpu else "host-timer"
    return {n: _summarize(v, is_performance=on_gpu, method=method, l2_flushed=on_gpu and flush_l2, device=device,
                          mode="graph" if graphed else "eager",
                          host_us=math.nan if graphed else statistics.median(hosts[n]) * 1e6)
            for n, v in samples.items()}


def host_time_us(fn: Callable[[], Any], *, calls: int = 200, warmup: int = 20) -> dict[str, float]:
    """Host time per call of ``fn``: ``calls`` back-to-back calls, each timed on
    the host clock alone, with no synchronization in between (what a Python
    loop pays before its kernels can start). Returns microseconds:
    ``median_us``, ``q25_us``, ``q75_us``, ``min_us`` and ``calls``. The GPU is
    drained before and after, never in between.
    """
    sync = _synchronize_if_gpu
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    s = sorted(times)
    return {"median_us": float(statistics.median(s)), "q25_us": _quantile(s, 0.25), "q75_us": _quantile(s, 0.75),
            "min_us": float(s[0]), "calls": len(s)}


def _synchronize_if_gpu() -> None:
    if gpu_timing_available():
        import torch

        torch.cuda.synchronize()
