"""Declared parameter sweeps: experiment YAML -> points -> rows (parquet).

    workbench sweep experiments/gemm_tiling.yaml [--quick] [--results DIR]

or from Python::

    from workbench import sweep
    df = sweep.run_spec("experiments/gemm_tiling.yaml", quick=True)

Experiment spec (YAML)
----------------------
::

    name: gemm_tiling              # results go to results/<name>/ (default: file stem)
    kernel: kernels.gemm           # module implementing the protocol below
    description: free text
    variant: triton                # name of the kernel's rows (default "triton")
    dtypes: [bfloat16]             # bfloat16/bf16, float16/fp16, float32/fp32
    world_size: 1                  # reserved for multi-GPU kernels (only 1 today)
    seed: 0                        # inputs are drawn from seed + shape
    repeats: 1                     # independent repeats of every (point, variant)
    bench: {warmup_ms: 10, rep_ms: 40, flush_l2: true, cuda_graph: false}
    shapes:                        # a list, or named sets {targets: [...], extra: [...]}
      - {M: 8192, N: 8192, K: 8192}
      - {M: [512, 1024], N: 4096, K: 7168}   # lists expand as a product
    defaults: {group_m: 8}         # parameters every point starts from
    grid:                          # one product (a mapping) or a list of studies:
      - study: tiles
        shapes: [targets]          # named shape sets (default: all)
        configs:                   # explicit parameter sets ...
          - {block_m: 128, block_n: 256}
        params:                    # ... each crossed with this product
          num_stages: [3, 4]
    constraints:                   # Python expressions over params, shape, derived names
      - "smem_bytes <= SMEM_LIMIT"
    baselines: [cublas]            # names in the kernel module's `baselines`
    quick:                         # overrides for --quick (any key above but name/kernel)
      shapes: [...]

Errors in a spec name the field (``grid[1].params.block_m: ...``) and make the
command exit with status 2.

Kernel-module protocol
----------------------
Required (module level)::

    make_inputs(shape: dict, dtype: torch.dtype, device: str, seed: int) -> inputs
    run(inputs, **params) -> output tensor          # the kernel under study
    reference(inputs) -> tensor                     # higher precision truth
    flops(shape) -> int
    bytes_moved(shape, dtype) -> int                # fewest bytes: inputs once, outputs once
    tolerance(dtype) -> float                       # max ||out - ref|| / ||ref||
    baselines: dict[str, Callable[[inputs], tensor]]

Optional::

    PARAMS: dict[str, default]        # parameter names a grid may use (validated)
    poison(inputs)                    # fill outputs with NaN before the checked run
    check(out, ref, dtype) -> (ok, rel_err, message)   # replaces the norm check
    derived(shape, dtype, params) -> dict             # extra names for constraints
    label(params) -> str              # short configuration label for plots
    WORLD_SIZES: tuple[int, ...]      # reserved: world sizes the kernel supports

Every point runs once on poisoned outputs and is checked against
``reference`` before it is timed; baselines are checked the same way.

Rows
----
One row per (point, variant, repeat): shape columns (``M``, ``N``, ``K``...),
``dtype``, ``params`` (JSON) and ``p_<name>`` columns, ``config`` label,
``status`` (ok, wrong_result, compile_error, out_of_resources, out_of_memory,
invalid_config, runtime_error, cuda_error, crashed), ``error``, ``rel_err``,
timing (``median_ms``, ``q25_ms``, ``q75_ms``, ``n_runs``, ``is_performance``),
metrics (``tflops``, ``gbps``, ``frac_of_peak``) and provenance (git sha and
dirty flag, versions, device, world size, knobs, timestamp, hostname).

Rows are appended to ``results/<name>/rows.parquet`` every few points, so an
interrupted sweep loses little; a re-run skips every (point, variant, repeat)
already recorded on the same kind of device (``device_name``). A point that kills the process (a sticky CUDA error) is
marked in ``inflight.json`` first, recorded as ``crashed`` on the next run and
skipped.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import importlib
import itertools
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

__all__ = ["SpecError", "Spec", "Point", "load_spec", "parse_spec", "expand", "run_spec", "load_rows",
           "best_per_shape", "configure", "run", "DTYPE_NAMES"]

REPO_ROOT = Path(__file__).resolve().parents[1]

DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
TOP_KEYS = {"name", "kernel", "description", "variant", "dtypes", "world_size", "seed", "repeats", "bench",
            "shapes", "defaults", "grid", "constraints", "baselines", "quick"}
QUICK_KEYS = TOP_KEYS - {"name", "kernel", "quick", "description", "variant"}
BENCH_KEYS = {"warmup_ms": (int, float), "rep_ms": (int, float), "flush_l2": (bool,), "cuda_graph": (bool,),
              "min_reps": (int,), "max_reps": (int,)}
STUDY_KEYS = {"study", "shapes", "configs", "params"}
REQUIRED_PROTOCOL = ("make_inputs", "run", "reference", "flops", "bytes_moved", "tolerance")
RESERVED_COLUMNS = {"sweep", "kernel", "study", "point_id", "variant", "is_baseline", "repeat", "shape", "dtype",
                    "world_size", "params", "config", "status", "error", "rel_err", "tolerance"}
_SAFE_FUNCS = {"min": min, "max": max, "abs": abs, "ceil": math.ceil, "floor": math.floor, "log2": math.log2,
               "cdiv": lambda a, b: -(-a // b), "int": int, "bool": bool, "True": True, "False": False,
               "None": None}


class SpecError(ValueError):
    """A problem in an experiment spec; the message names the file and field."""


# --------------------------------------------------------------------------
# Spec
# --------------------------------------------------------------------------
@dataclasses.dataclass
class Study:
    name: str
    shape_sets: list[str] | None  # None: all
    configs: list[dict]
    params: dict[str, list]


@dataclasses.dataclass
class Spec:
    name: str
    kernel: str
    path: Path | None
    description: str
    variant: str
    dtypes: list[str]
    world_sizes: list[int]
    seed: int
    repeats: int
    bench: dict[str, Any]
    shapes: dict[str, list[dict]]  # set name -> shapes
    defaults: dict[str, Any]
    studies: list[Study]
    constraints: list[str]
    baselines: list[str]
    quick: bool = False
    module: Any = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class Point:
    study: str
    shape: tuple  # ((name, value), ...) in spec order
    dtype: str
    params: tuple  # sorted ((name, value), ...)
    world_size: int = 1
    baseline: str | None = None

    @property
    def shape_dict(self) -> dict:
        return dict(self.shape)

    @property
    def params_dict(self) -> dict:
        return dict(self.params)

    def point_id(self, kernel: str) -> str:
        key = {"kernel": kernel, "shape": self.shape_dict, "dtype": self.dtype, "params": self.params_dict,
               "world_size": self.world_size, "baseline": self.baseline}
        return hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _where(path: Path | None) -> str:
    return f"{path}: " if path else ""


def _err(spec_path, field: str, msg: str) -> SpecError:
    return SpecError(f"{_where(spec_path)}{field}: {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def load_spec(path: str | os.PathLike, *, quick: bool = False, import_kernel: bool = True) -> Spec:
    """Read and validate a YAML spec (``SpecError`` names the bad field)."""
    import yaml

    p = Path(path)
    if not p.exists():
        raise SpecError(f"{p}: no such experiment spec (expected e.g. experiments/NAME.yaml)")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"{p}: not valid YAML: {exc}") from None
    return parse_spec(raw, path=p, quick=quick, import_kernel=import_kernel)


def parse_spec(raw: Any, *, path: Path | None = None, quick: bool = False, import_kernel: bool = True) -> Spec:
    """Validate a spec already read into Python objects."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"{_where(path)}the spec must be a mapping of fields, got {type(raw).__name__}")
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise _err(path, unknown[0], f"unknown field (known: {', '.join(sorted(TOP_KEYS))})")
    data = dict(raw)
    if quick:
        q = data.get("quick")
        if q is None:
            raise _err(path, "quick", "--quick asked for but the spec has no 'quick:' section")
        if not isinstance(q, Mapping):
            raise _err(path, "quick", f"expected a mapping of overrides, got {type(q).__name__}")
        bad = sorted(set(q) - QUICK_KEYS)
        if bad:
            raise _err(path, f"quick.{bad[0]}", f"cannot be overridden (allowed: {', '.join(sorted(QUICK_KEYS))})")
        data.update(q)
    prefix = "quick." if quick else ""

    def field(name):  # the field's name as the user wrote it (quick-overridden ones say so)
        return f"{prefix}{name}" if quick and name in (raw.get("quick") or {}) else name

    name = data.get("name", path.stem if path else None)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name or ""):
        raise _err(path, "name", f"expected a name of letters, digits, '_', '.', '-', got {name!r}")
    kernel = data.get("kernel")
    if not isinstance(kernel, str) or not re.fullmatch(r"[A-Za-z_][\w.]*", kernel):
        raise _err(path, "kernel", f"expected a module path such as kernels.gemm, got {kernel!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise _err(path, "description", "expected text")
    variant = data.get("variant", "triton")
    if not isinstance(variant, str) or not variant:
        raise _err(path, "variant", f"expected a non-empty name, got {variant!r}")

    dtypes_raw = data.get("dtypes", ["bfloat16"])
    if isinstance(dtypes_raw, str):
        dtypes_raw = [dtypes_raw]
    if not isinstance(dtypes_raw, list) or not dtypes_raw:
        raise _err(path, field("dtypes"), "expected a non-empty list such as [bfloat16, float16]")
    dtypes = []
    for i, d in enumerate(dtypes_raw):
        if d not in DTYPE_NAMES:
            raise _err(path, f"{field('dtypes')}[{i}]", f"unknown dtype {d!r} (known: {', '.join(DTYPE_NAMES)})")
        dtypes.append(DTYPE_NAMES[d])

    ws_raw = data.get("world_size", 1)
    ws_list = ws_raw if isinstance(ws_raw, list) else [ws_raw]
    for i, w in enumerate(ws_list):
        if not _is_int(w) or w < 1:
            raise _err(path, field("world_size"), f"expected a positive integer (or a list), got {w!r}")
        if w != 1:
            raise _err(path, field("world_size"), f"{w}: world sizes above 1 are reserved for multi-GPU kernels "
                       "and not launched by the sweep yet; use 1")

    seed = data.get("seed", 0)
    if not _is_int(seed):
        raise _err(path, field("seed"), f"expected an integer, got {seed!r}")
    repeats = data.get("repeats", 1)
    if not _is_int(repeats) or repeats < 1:
        raise _err(path, field("repeats"), f"expected an integer >= 1, got {repeats!r}")

    bench_raw = data.get("bench", {}) or {}
    if not isinstance(bench_raw, Mapping):
        raise _err(path, field("bench"), "expected a mapping such as {warmup_ms: 10, rep_ms: 40}")
    bench = {}
    for k, v in bench_raw.items():
        if k not in BENCH_KEYS:
            raise _err(path, f"{field('bench')}.{k}", f"unknown setting (known: {', '.join(BENCH_KEYS)})")
        if not isinstance(v, BENCH_KEYS[k]) or (isinstance(v, bool) and bool not in BENCH_KEYS[k]):
            raise _err(path, f"{field('bench')}.{k}", f"expected {BENCH_KEYS[k][0].__name__}, got {v!r}")
        if (k.endswith("_ms") and v < 0) or (k.endswith("_reps") and v < 1):
            raise _err(path, f"{field('bench')}.{k}", f"must be >= 0, got {v!r}")
        bench[k] = v

    shapes = _parse_shapes(data.get("shapes"), path, field("shapes"))

    module = _import_kernel(kernel, path) if import_kernel else None
    known_params = dict(getattr(module, "PARAMS", {}) or {}) if module is not None else None

    defaults = data.get("defaults", {}) or {}
    if not isinstance(defaults, Mapping):
        raise _err(path, field("defaults"), "expected a mapping of parameter: value")
    for k, v in defaults.items():
        _check_param_name(k, known_params, kernel, path, f"{field('defaults')}.{k}")
        _check_scalar(v, path, f"{field('defaults')}.{k}")

    studies = _parse_grid(data.get("grid"), path, field("grid"), known_params, kernel, set(shapes))

    constraints_raw = data.get("constraints", []) or []
    if isinstance(constraints_raw, str):
        constraints_raw = [constraints_raw]
    if not isinstance(constraints_raw, list):
        raise _err(path, field("constraints"), "expected a list of expressions")
    for i, c in enumerate(constraints_raw):
        if not isinstance(c, str):
            raise _err(path, f"{field('constraints')}[{i}]", f"expected an expression string, got {c!r}")
        try:
            ast.parse(c, mode="eval")
        except SyntaxError as exc:
            raise _err(path, f"{field('constraints')}[{i}]", f"invalid expression {c!r}: {exc.msg}") from None

    baselines_raw = data.get("baselines", []) or []
    if isinstance(baselines_raw, str):
        baselines_raw = [baselines_raw]
    if not isinstance(baselines_raw, list):
        raise _err(path, field("baselines"), "expected a list of baseline names")
    if module is not None:
        available = dict(getattr(module, "baselines", {}) or {})
        for i, b in enumerate(baselines_raw):
            if b not in available:
                raise _err(path, f"{field('baselines')}[{i}]",
                           f"{b!r} is not in {kernel}.baselines (available: {', '.join(available) or 'none'})")

    spec = Spec(name=name, kernel=kernel, path=path, description=description, variant=variant, dtypes=dtypes,
                world_sizes=sorted(set(ws_list)), seed=seed, repeats=repeats, bench=bench, shapes=shapes,
                defaults=dict(defaults), studies=studies, constraints=list(constraints_raw),
                baselines=list(baselines_raw), quick=quick, module=module)
    if module is not None:
        points = expand(spec)  # evaluates constraints: unknown names are spec errors too
        if not points:
            raise _err(path, field("grid"), "the grid and constraints leave no point to run")
    return spec


def _parse_shapes(raw, path, fname) -> dict[str, list[dict]]:
    if raw is None:
        raise _err(path, fname, "missing: give a list of shapes such as [{M: 1024, N: 1024, K: 1024}]")
    sets = raw if isinstance(raw, Mapping) else {"default": raw}
    out: dict[str, list[dict]] = {}
    for set_name, items in sets.items():
        where = f"{fname}.{set_name}" if isinstance(raw, Mapping) else fname
        if not isinstance(items, list) or not items:
            raise _err(path, where, "expected a non-empty list of shapes (mappings of dimension: size)")
        expanded = []
        for i, s in enumerate(items):
            if not isinstance(s, Mapping) or not s:
                raise _err(path, f"{where}[{i}]", f"expected a mapping such as {{M: 64, N: 64, K: 64}}, got {s!r}")
            keys, values = [], []
            for k, v in s.items():
                if not isinstance(k, str) or k in RESERVED_COLUMNS or k.startswith("p_"):
                    raise _err(path, f"{where}[{i}].{k}", "dimension names must be text and not a result column")
                vs = v if isinstance(v, list) else [v]
                if not vs or not all(_is_int(x) and x >= 0 for x in vs):
                    raise _err(path, f"{where}[{i}].{k}", f"expected an integer >= 0 or a list of them, got {v!r}")
                keys.append(k)
                values.append(vs)
            for combo in itertools.product(*values):
                expanded.append(dict(zip(keys, combo)))
        out[str(set_name)] = expanded
    return out


def _check_param_name(k, known, kernel, path, where):
    if not isinstance(k, str):
        raise _err(path, where, "parameter names must be text")
    if known is not None and known and k not in known:
        raise _err(path, where, f"unknown parameter for {kernel} (known: {', '.join(sorted(known))})")


def _check_scalar(v, path, where):
    if not (v is None or isinstance(v, (bool, int, float, str))):
        raise _err(path, where, f"expected a scalar value (number, bool, text or null), got {v!r}")


def _parse_grid(raw, path, fname, known, kernel, shape_sets) -> list[Study]:
    if raw is None:
        return [Study("default", None, [{}], {})]
    entries = [raw] if isinstance(raw, Mapping) and not ("params" in raw or "configs" in raw) else raw
    if isinstance(entries, Mapping):
        entries = [entries]
    if not isinstance(entries, list) or not entries:
        raise _err(path, fname, "expected a mapping of parameter: [values] or a list of studies")
    studies = []
    single = isinstance(raw, Mapping) and not ("params" in raw or "configs" in raw)
    for i, e in enumerate(entries):
        where = fname if single else f"{fname}[{i}]"
        if not isinstance(e, Mapping):
            raise _err(path, where, f"expected a study mapping (study, shapes, configs, params), got {e!r}")
        if single:
            e = {"study": "grid", "params": e}
        bad = sorted(set(e) - STUDY_KEYS)
        if bad:
            raise _err(path, f"{where}.{bad[0]}", f"unknown study field (known: {', '.join(sorted(STUDY_KEYS))})")
        sname = e.get("study", f"study{i}")
        if not isinstance(sname, str) or not sname:
            raise _err(path, f"{where}.study", f"expected a name, got {sname!r}")
        sets = e.get("shapes")
        if sets is not None:
            if isinstance(sets, str):
                sets = [sets]
            if not isinstance(sets, list) or not all(isinstance(s, str) for s in sets):
                raise _err(path, f"{where}.shapes", "expected a list of shape-set names")
            for s in sets:
                if s not in shape_sets:
                    raise _err(path, f"{where}.shapes", f"no shape set {s!r} (sets: {', '.join(sorted(shape_sets))})")
        configs = e.get("configs", [{}])
        if not isinstance(configs, list) or not configs:
            raise _err(path, f"{where}.configs", "expected a non-empty list of parameter mappings")
        for j, c in enumerate(configs):
            if not isinstance(c, Mapping):
                raise _err(path, f"{where}.configs[{j}]", f"expected a mapping of parameter: value, got {c!r}")
            for k, v in c.items():
                _check_param_name(k, known, kernel, path, f"{where}.configs[{j}].{k}")
                _check_scalar(v, path, f"{where}.configs[{j}].{k}")
        params = e.get("params", {}) or {}
        if not isinstance(params, Mapping):
            raise _err(path, f"{where}.params", "expected a mapping of parameter: [values]")
        plist = {}
        for k, v in params.items():
            _check_param_name(k, known, kernel, path, f"{where}.params.{k}")
            vs = v if isinstance(v, list) else [v]
            if not vs:
                raise _err(path, f"{where}.params.{k}", "expected a non-empty list of values")
            for x in vs:
                _check_scalar(x, path, f"{where}.params.{k}")
            plist[k] = vs
        studies.append(Study(sname, sets, [dict(c) for c in configs], plist))
    return studies


def _import_kernel(kernel: str, path):
    _maybe_interpreter()
    try:
        module = importlib.import_module(kernel)
    except ImportError as exc:
        raise _err(path, "kernel", f"cannot import {kernel!r} ({exc}); run from the repository root or "
                   "install the package (pip install -e .)") from None
    missing = [f for f in REQUIRED_PROTOCOL if not callable(getattr(module, f, None))]
    if missing:
        raise _err(path, "kernel", f"{kernel} lacks {', '.join(missing)} of the sweep protocol "
                   "(see `workbench.sweep` docs: make_inputs, run, reference, flops, bytes_moved, tolerance, baselines)")
    return module


def _maybe_interpreter() -> None:
    """On a machine without a GPU, kernels run in Triton's interpreter: it must
    be chosen before a kernel module (and its @triton.jit) is imported."""
    if os.environ.get("TRITON_INTERPRET") is not None:
        return
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover
        pass


# --------------------------------------------------------------------------
# Expansion
# --------------------------------------------------------------------------
def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _constraint_namespace(spec: Spec, shape: dict, dtype: str, params: dict) -> dict:
    ns = dict(_SAFE_FUNCS)
    ns.update(shape)
    ns.update(params)
    ns["dtype"] = dtype
    derived = getattr(spec.module, "derived", None) if spec.module is not None else None
    if callable(derived):
        ns.update(derived(shape, _torch_dtype(dtype), params))
    return ns


def _satisfies(spec: Spec, shape: dict, dtype: str, params: dict) -> bool:
    if not spec.constraints:
        return True
    ns = _constraint_namespace(spec, shape, dtype, params)
    for i, c in enumerate(spec.constraints):
        try:
            ok = eval(compile(c, f"constraints[{i}]", "eval"), {"__builtins__": {}}, ns)  # noqa: S307
        except NameError as exc:
            names = ", ".join(sorted(k for k in ns if k not in _SAFE_FUNCS))
            raise _err(spec.path, f"constraints[{i}]", f"{exc} in {c!r} (names: {names})") from None
        except Exception as exc:
            raise _err(spec.path, f"constraints[{i}]", f"{type(exc).__name__}: {exc} in {c!r} "
                       f"for shape {shape} and params {params}") from None
        if not ok:
            return False
    return True


def expand(spec: Spec) -> list[Point]:
    """All kernel points (constraints applied, duplicates dropped) then baselines."""
    points: list[Point] = []
    seen: set = set()
    # Points carry every parameter (the module's defaults filled in), so one
    # configuration reached from two studies is one point.
    base = dict(getattr(spec.module, "PARAMS", {}) or {}) if spec.module is not None else {}
    for study in spec.studies:
        set_names = study.shape_sets or list(spec.shapes)
        shapes = [s for n in set_names for s in spec.shapes[n]]
        keys = list(study.params)
        products = [dict(zip(keys, combo)) for combo in itertools.product(*(study.params[k] for k in keys))]
        for dtype in spec.dtypes:
            for shape in shapes:
                for cfg in study.configs:
                    for prod in products:
                        params = {**base, **spec.defaults, **cfg, **prod}
                        for ws in spec.world_sizes:
                            key = (tuple(shape.items()), dtype, tuple(sorted(params.items())), ws)
                            if key in seen or not _satisfies(spec, shape, dtype, params):
                                continue
                            seen.add(key)
                            points.append(Point(study.name, key[0], dtype, key[2], ws))
    base_keys = []
    for p in points:
        k = (p.shape, p.dtype, p.world_size)
        if k not in base_keys:
            base_keys.append(k)
    for shape, dtype, ws in base_keys:
        for b in spec.baselines:
            points.append(Point("baseline", shape, dtype, (), ws, baseline=b))
    return points


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------
def _classify(exc: BaseException) -> str:
    names = {c.__name__ for c in type(exc).__mro__}
    mod = type(exc).__module__ or ""
    if "OutOfResources" in names:
        return "out_of_resources"
    if "OutOfMemoryError" in names:
        return "out_of_memory"
    if "CompilationError" in names or "CompileTimeAssertionFailure" in names or (
            mod.startswith("triton.compiler") and "Error" in type(exc).__name__):
        return "compile_error"
    text = str(exc)
    if "PassManager::run failed" in text or "ptxas" in text.lower():
        return "compile_error"
    if "CUDA error" in text or "cudaError" in text or "CUDA driver error" in text or "AcceleratorError" in names:
        return "cuda_error"
    if isinstance(exc, ValueError):
        return "invalid_config"
    return "runtime_error"


def _error_text(exc: BaseException, limit: int = 2000) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2:]


def _default_check(out, ref, tol):
    import torch

    o = out.float()
    r = ref.float()
    bad = (~torch.isfinite(o)).sum().item()
    if bad:
        return False, math.nan, f"{bad} of {o.numel()} outputs are not finite (unwritten outputs are poisoned with NaN)"
    denom = torch.linalg.vector_norm(r).item()
    err = torch.linalg.vector_norm(o - r).item() / (denom if denom > 0 else 1.0)
    if err > tol:
        return False, err, f"relative error {err:.3e} > tolerance {tol:.1e}"
    return True, err, ""


def _context_alive() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:
        return False
    return True


class _RowStore:
    """rows.parquet under the results folder, rewritten atomically on each flush."""

    def __init__(self, folder: Path):
        import pandas as pd

        self.folder = folder
        self.path = folder / "rows.parquet"
        self.pending: list[dict] = []
        self.existing = pd.read_parquet(self.path) if self.path.exists() else None

    def done_keys(self, device_name: str | None = None) -> set:
        """(point_id, variant, repeat) already recorded (on ``device_name``, if given)."""
        df = self.existing
        if df is None or df.empty:
            return set()
        if device_name is not None and "device_name" in df:
            df = df[df["device_name"] == device_name]
        return set(zip(df["point_id"], df["variant"], df["repeat"].astype(int)))

    def add(self, row: dict) -> None:
        self.pending.append(row)

    def flush(self) -> None:
        import pandas as pd

        if not self.pending:
            return
        new = pd.DataFrame(self.pending)
        frames = [f for f in (self.existing, new) if f is not None and not f.empty]
        df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        df = _normalize_frame(df)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".parquet.tmp")
        df.to_parquet(tmp, index=False)
        os.replace(tmp, self.path)
        self.existing = df
        self.pending = []

    def frame(self):
        import pandas as pd

        self.flush()
        return self.existing if self.existing is not None else pd.DataFrame()


def _normalize_frame(df):
    # Mixed-type object columns (e.g. a parameter that is None or an int) must be one type for parquet.
    for col in df.columns:
        if df[col].dtype == object:
            kinds = {type(v) for v in df[col] if v is not None and not (isinstance(v, float) and math.isnan(v))}
            if len(kinds) > 1 and not kinds <= {int, float}:
                df[col] = df[col].map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v))
                                      else str(v))
    return df


def default_results_dir(spec: Spec) -> Path:
    root = spec.path.resolve().parent.parent if spec.path else REPO_ROOT
    if not (root / "results").exists() and (REPO_ROOT / "results").exists():
        root = REPO_ROOT
    return root / "results" / spec.name


def _peak(ceil: Mapping | None, dtype: str):
    if not ceil:
        return None, None
    key = {"bfloat16": "bf16_tflops", "float16": "fp16_tflops"}.get(dtype)
    return (ceil.get(key) if key else None), ceil.get("copy_gbps")


def run_spec(spec: Spec | str | os.PathLike, *, quick: bool = False, results_dir: str | os.PathLike | None = None,
             resume: bool = True, progress: bool = True, limit: int | None = None, flush_every: int = 20,
             ceilings: Mapping | None = None, deadline_s: float | None = None, flush_s: float = 10.0,
             on_row: Callable[[dict], None] | None = None, log: Callable[[str], None] | None = None):
    """Run a sweep; return all rows of its results folder as a DataFrame.

    resume: skip (point, variant, repeat) triples already in rows.parquet.
    limit: run at most this many new rows (for a look before the full run).
    deadline_s: start no new row after this many seconds (the rest stays for a
        resumed run).
    flush_s / flush_every: rows reach the parquet file at least this often.
    on_row: called with each finished row (e.g. a watchdog's heartbeat).
    ceilings: measured ceilings (``workbench.roofline``) for ``frac_of_peak``;
        by default the cached ones for this device, if any.
    """
    from tqdm.auto import tqdm

    from . import bench, provenance

    log = log or (lambda s: print(s, file=sys.stderr))
    if not isinstance(spec, Spec):
        spec = load_spec(spec, quick=quick)
    module = spec.module or _import_kernel(spec.kernel, spec.path)
    spec.module = module
    points = expand(spec)

    import torch

    device = "cuda" if bench.gpu_timing_available() else "cpu"
    folder = Path(results_dir) if results_dir else default_results_dir(spec)
    folder.mkdir(parents=True, exist_ok=True)
    store = _RowStore(folder)
    prov = provenance.flat(provenance.collect(world_size=max(spec.world_sizes),
                                              knobs={"sweep": spec.name, "quick": spec.quick}))
    # Resume skips what this kind of device already measured (rows from another
    # device, e.g. committed H200 results on a laptop, are kept but not counted).
    done = store.done_keys(prov["device_name"]) if resume else set()
    if not resume and store.existing is not None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        os.replace(store.path, folder / f"rows.{stamp}.parquet.bak")
        store.existing = None
        log(f"sweep {spec.name}: previous rows moved to rows.{stamp}.parquet.bak")
    if ceilings is None and device == "cuda":
        try:
            from . import roofline

            ceilings = roofline.load_ceilings()
        except Exception:
            ceilings = None

    run_id = hashlib.sha1(f"{prov['timestamp']}{os.getpid()}".encode()).hexdigest()[:10]
    inflight = folder / "inflight.json"
    meta_base = {"sweep": spec.name, "kernel": spec.kernel, "run_id": run_id}

    def base_row(p: Point, rep: int) -> dict:
        shape = p.shape_dict
        params = p.params_dict
        label_fn = getattr(module, "label", None)
        row = {**meta_base, "study": p.study, "point_id": p.point_id(spec.kernel),
               "variant": p.baseline or spec.variant, "is_baseline": p.baseline is not None, "repeat": rep,
               **shape, "shape": json.dumps(shape), "dtype": p.dtype, "world_size": p.world_size,
               "params": json.dumps(params, sort_keys=True),
               "config": p.baseline if p.baseline else (label_fn(params) if callable(label_fn) else
                                                        json.dumps(params, sort_keys=True)),
               "flops": int(module.flops(shape)), "bytes": int(module.bytes_moved(shape, _torch_dtype(p.dtype)))}
        for k in _all_param_names(spec, points):
            row[f"p_{k}"] = params.get(k)
        return row

    # A point that killed the previous process: record it and skip it.
    if inflight.exists():
        try:
            info = json.loads(inflight.read_text())
            key = (info["point_id"], info["variant"], int(info["repeat"]))
            if key not in done:
                match = next((p for p in points if p.point_id(spec.kernel) == key[0]
                              and (p.baseline or spec.variant) == key[1]), None)
                if match is not None:
                    row = base_row(match, key[2])
                    row.update(status="crashed", error="the process died while running this point "
                               "(sticky CUDA error, kill or timeout); marked and skipped on resume",
                               **{k: v for k, v in prov.items() if k != "timestamp"}, timestamp=prov["timestamp"])
                    store.add(row)
                    store.flush()
                    done.add(key)
                    log(f"sweep {spec.name}: point {key[0]} ({key[1]}) crashed the last run; recorded and skipped")
        except (ValueError, KeyError, OSError):
            pass
        inflight.unlink(missing_ok=True)

    tasks = [(p, r) for p in points for r in range(spec.repeats)
             if (p.point_id(spec.kernel), p.baseline or spec.variant, r) not in done]
    skipped = len(points) * spec.repeats - len(tasks)
    # Group by (dtype, shape) so inputs and the reference are made once per shape.
    order = {}
    for p, _ in tasks:
        order.setdefault((p.dtype, p.shape, p.world_size), len(order))
    tasks.sort(key=lambda t: order[(t[0].dtype, t[0].shape, t[0].world_size)])
    if limit is not None:
        tasks = tasks[:limit]

    bench_kw = {"warmup_ms": 25, "rep_ms": 100, "flush_l2": True, "cuda_graph": False, **spec.bench}
    counts: dict[str, int] = {}
    aborted = None
    current_key = None
    inputs = ref = None
    poison = getattr(module, "poison", None)
    check = getattr(module, "check", None)
    t_start = last_flush = time.monotonic()
    stopped = 0
    bar = tqdm(total=len(tasks), desc=f"sweep {spec.name}", unit="pt", file=sys.stderr, disable=not progress,
               dynamic_ncols=True, mininterval=0.5)
    try:
        for i_task, (p, rep) in enumerate(tasks):
            if deadline_s is not None and time.monotonic() - t_start > deadline_s:
                stopped = len(tasks) - i_task
                break
            key = (p.dtype, p.shape, p.world_size)
            row = base_row(p, rep)
            dtype = _torch_dtype(p.dtype)
            tol = float(module.tolerance(dtype))
            row["tolerance"] = tol
            inflight.write_text(json.dumps({"point_id": row["point_id"], "variant": row["variant"], "repeat": rep}))
            status, error, timing, rel_err = "ok", "", None, math.nan
            try:
                if key != current_key:
                    inputs = ref = None
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    seed = spec.seed + int(hashlib.sha1(json.dumps(p.shape).encode()).hexdigest()[:6], 16)
                    inputs = module.make_inputs(p.shape_dict, dtype, device, seed)
                    ref = module.reference(inputs)
                    current_key = key
                fn = (lambda: module.baselines[p.baseline](inputs)) if p.baseline else (
                    lambda: module.run(inputs, **p.params_dict))
                if callable(poison):
                    poison(inputs)
                out = fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                if callable(check):
                    ok, rel_err, msg = check(out, ref, dtype)
                else:
                    ok, rel_err, msg = _default_check(out, ref, tol)
                if not ok:
                    status, error = "wrong_result", msg
                else:
                    timing = bench.measure(fn, **bench_kw)
            except Exception as exc:  # failure isolation: record and go on
                status, error = _classify(exc), _error_text(exc)
                if device == "cuda" and not _context_alive():
                    status = "cuda_error"
                    aborted = (f"the CUDA context is unusable after point {row['point_id']} ({row['config']}, "
                               f"shape {p.shape_dict}); rows are saved; re-run to resume (this point is skipped)")
            row.update(status=status, error=error, rel_err=rel_err)
            if timing is not None:
                row.update(timing.as_row())
                row["tflops"] = timing.tflops(row["flops"])
                row["gbps"] = timing.gbps(row["bytes"])
                peak_t, peak_bw = _peak(ceilings, p.dtype)
                row["frac_of_peak"] = timing.fraction_of_ceiling(
                    flops=row["flops"], nbytes=row["bytes"], peak_tflops=peak_t, peak_gbps=peak_bw) \
                    if (peak_t or peak_bw) else math.nan
            else:
                row.update(median_ms=math.nan, tflops=math.nan, gbps=math.nan, frac_of_peak=math.nan,
                           is_performance=device == "cuda")
            row.update({k: v for k, v in prov.items() if k != "timestamp"})
            row["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
            store.add(row)
            counts[status] = counts.get(status, 0) + 1
            bar.update(1)
            if timing is not None:
                bar.set_postfix_str(f"{row['config'][:28]} {row['tflops']:.1f} TFLOP/s", refresh=False)
            if len(store.pending) >= flush_every or time.monotonic() - last_flush > flush_s:
                store.flush()
                last_flush = time.monotonic()
            if on_row is not None:
                on_row(row)
            inflight.unlink(missing_ok=True)
            if aborted:
                break
    except KeyboardInterrupt:
        store.flush()
        inflight.unlink(missing_ok=True)
        bar.close()
        raise
    bar.close()
    store.flush()
    df = store.frame()
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "nothing new"
    log(f"sweep {spec.name}: {sum(counts.values())} rows run ({summary}); {skipped} already recorded; "
        f"{len(df)} rows in {store.path}" + ("" if device == "cuda" else " [CPU/interpreter: not performance]")
        + (f"; stopped at the deadline with {stopped} rows left (re-run to resume)" if stopped else ""))
    if aborted:
        raise SweepAborted(aborted)
    return df


class SweepAborted(RuntimeError):
    """The process can no longer run kernels (sticky CUDA error); rows are saved."""


def _all_param_names(spec: Spec, points: list[Point]) -> list[str]:
    names = dict.fromkeys(getattr(spec.module, "PARAMS", {}) or {})
    for p in points:
        for k, _ in p.params:
            names.setdefault(k)
    return list(names)


# --------------------------------------------------------------------------
# Reading results
# --------------------------------------------------------------------------
def load_rows(name_or_path: str | os.PathLike):
    """Rows of a sweep: a results folder, a parquet/CSV file, or a sweep name under results/."""
    import pandas as pd

    p = Path(name_or_path)
    if not p.exists():
        p = REPO_ROOT / "results" / str(name_or_path)
    if p.is_dir():
        files = sorted(p.glob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"{p}: no parquet files (run `workbench sweep experiments/{p.name}.yaml`)")
        return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    if p.suffix == ".csv":
        return pd.read_csv(p)
    return pd.read_parquet(p)


def best_per_shape(df, *, shape_cols: Iterable[str] = ("M", "N", "K"), baseline: str | None = "cublas"):
    """The fastest ok kernel row per (shape, dtype), with the baseline's time and the ratio."""
    import pandas as pd

    cols = list(shape_cols) + ["dtype"]
    ok = df[(df["status"] == "ok") & (~df["is_baseline"].astype(bool))]
    if ok.empty:
        return pd.DataFrame()
    best = ok.loc[ok.groupby(cols)["median_ms"].idxmin()].copy()
    if baseline is not None:
        base = df[(df["variant"] == baseline) & (df["status"] == "ok")].groupby(cols)["median_ms"].median()
        best = best.join(base.rename(f"{baseline}_ms"), on=cols)
        best[f"speedup_vs_{baseline}"] = best[f"{baseline}_ms"] / best["median_ms"]
    return best.reset_index(drop=True)


# --------------------------------------------------------------------------
# CLI: workbench sweep
# --------------------------------------------------------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Run a declared parameter sweep (experiments/NAME.yaml) into results/NAME/rows.parquet."
    parser.add_argument("spec", help="experiment spec, e.g. experiments/gemm_tiling.yaml")
    parser.add_argument("--quick", action="store_true", help="run the spec's quick: subset")
    parser.add_argument("--results", metavar="DIR", help="results folder (default results/NAME)")
    parser.add_argument("--fresh", action="store_true",
                        help="do not resume: move existing rows aside and run every point again")
    parser.add_argument("--limit", type=int, metavar="N", help="run at most N new rows")
    parser.add_argument("--dry-run", action="store_true", help="validate and count points, run nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    try:
        spec = load_spec(args.spec, quick=args.quick)
    except SpecError as exc:
        print(f"workbench sweep: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        points = expand(spec)
        kern = sum(1 for p in points if p.baseline is None)
        print(f"{spec.path}: {kern} kernel points + {len(points) - kern} baseline points x {spec.repeats} "
              f"repeat(s) over {sum(len(v) for v in spec.shapes.values())} shapes; spec OK")
        return 0
    try:
        run_spec(spec, results_dir=args.results, resume=not args.fresh, progress=not args.no_progress,
                 limit=args.limit)
    except SpecError as exc:
        print(f"workbench sweep: error: {exc}", file=sys.stderr)
        return 2
    except SweepAborted as exc:
        print(f"workbench sweep: aborted: {exc}", file=sys.stderr)
        return 1
    return 0
