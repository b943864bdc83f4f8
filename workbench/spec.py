"""Experiment specs: YAML -> a validated ``Spec`` -> expanded ``Point``s (``workbench.sweep`` runs them).

    from workbench import spec
    s = spec.load_spec("experiments/gemm_tiling.yaml", quick=True)
    points = spec.expand(s)

Experiment spec (YAML)
----------------------
::

    name: gemm_tiling              # results go to results/<name>/ (default: file stem)
    kernel: kernels.gemm.sweep     # module implementing the protocol below (a module of this
                                   # project, or of a package in $WORKBENCH_KERNEL_PACKAGES)
    description: free text
    variant: triton                # name of the kernel's rows (default "triton")
    dtypes: [bfloat16]             # bfloat16/bf16, float16/fp16, float32/fp32
    world_size: 1                  # or a list such as [2, 4]: ranks per point (see "Worlds")
    launch_timeout_s: 7200         # worlds only: deadline for one world, all its points
    point_timeout_s: 600           # worlds only: a rank this long in one step of a point is hung
    seed: 0                        # inputs are drawn from seed + shape
    repeats: 1                     # independent repeats of every (point, variant)
    bench: {warmup_ms: 10, rep_ms: 40, flush_l2: true, cuda_graph: false}
    shapes:                        # a list, or named sets {targets: [...], extra: [...]}
      - {M: 8192, N: 8192, K: 8192}
      - {M: [512, 1024], N: 4096, K: 7168}   # lists expand as a product
                                   # values: numbers >= 0 or names (text), e.g.
                                   # {tokens: 4096, routing: zipf, skew: 1.2}
    defaults: {group_m: 8}         # parameters every point starts from
    grid:                          # one product (a mapping) or a list of studies:
      - study: tiles
        shapes: [targets]          # named shape sets (default: all)
        configs:                   # explicit parameter sets ...
          - {block_m: 128, block_n: 256}
        params:                    # ... each crossed with this product
          num_stages: [3, 4]
    constraints:                   # expressions over params, shape, derived names: arithmetic,
      - "smem_bytes <= SMEM_LIMIT"  # comparisons, and/or/not, min/max/ceil/floor/log2/cdiv...
                                   # (workbench.safe_expr: nothing else, checked when loaded)
    baselines: [cublas]            # names in the kernel module's `baselines`
    quick:                         # overrides for --quick (any key above but name/kernel)
      shapes: [...]

A spec is untrusted input: it is read bounded (``workbench.safe_yaml``), its
expressions never reach ``eval``, and a grid may expand to at most
``MAX_POINTS`` points. Errors in a spec name the field (``grid[1].params.block_m: ...``) and make the
command exit with status 2.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import itertools
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from . import safe_expr

__all__ = ["SpecError", "Spec", "Study", "Point", "load_spec", "parse_spec", "expand", "DTYPE_NAMES", "clip_text",
           "torch_dtype", "load_kernel_module"]

REPO_ROOT = Path(__file__).resolve().parents[1]

DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
TOP_KEYS = {"name", "kernel", "description", "variant", "dtypes", "world_size", "seed", "repeats", "bench",
            "shapes", "defaults", "grid", "constraints", "baselines", "quick", "launch_timeout_s", "point_timeout_s"}
LAUNCH_TIMEOUT_S = 7200.0  # one world, all its points
POINT_TIMEOUT_S = 600.0  # one rank in one step of one point
QUICK_KEYS = TOP_KEYS - {"name", "kernel", "quick", "description", "variant"}
BENCH_KEYS = {"warmup_ms": (int, float), "rep_ms": (int, float), "flush_l2": (bool,), "cuda_graph": (bool,),
              "min_reps": (int,), "max_reps": (int,)}
STUDY_KEYS = {"study", "shapes", "configs", "params"}
REQUIRED_PROTOCOL = ("make_inputs", "run", "reference", "flops", "bytes_moved", "tolerance")
RESERVED_COLUMNS = {"sweep", "kernel", "study", "point_id", "variant", "is_baseline", "repeat", "shape", "dtype",
                    "world_size", "params", "config", "status", "error", "rel_err", "tolerance"}
MAX_POINTS = 100_000  # points one spec may expand to (shapes x dtypes x configs x params x repeats); a typo guard


def clip_text(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2:]


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
    launch_timeout_s: float = LAUNCH_TIMEOUT_S
    point_timeout_s: float = POINT_TIMEOUT_S


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
    from . import safe_yaml

    p = Path(path)
    if not p.exists():
        raise SpecError(f"{p}: no such experiment spec (expected e.g. experiments/NAME.yaml)")
    try:  # specs are shared: read as untrusted input (bounded, no Python objects)
        raw = safe_yaml.load_file(p)
    except safe_yaml.YamlError as exc:
        raise SpecError(str(exc)) from None
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
        raise _err(path, "kernel", f"expected a module path such as kernels.gemm.sweep, got {kernel!r}")
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
    if not ws_list:
        raise _err(path, field("world_size"), "expected a positive integer or a non-empty list of them")
    for i, w in enumerate(ws_list):
        if not _is_int(w) or w < 1:
            raise _err(path, field("world_size"), f"expected a positive integer (or a list), got {w!r}")

    timeouts = {}
    for key, default in (("launch_timeout_s", LAUNCH_TIMEOUT_S), ("point_timeout_s", POINT_TIMEOUT_S)):
        v = data.get(key, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise _err(path, field(key), f"expected a number of seconds > 0, got {v!r}")
        timeouts[key] = float(v)

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

    constraints_raw = data.get("constraints", []) or []
    if isinstance(constraints_raw, str):
        constraints_raw = [constraints_raw]
    if not isinstance(constraints_raw, list):
        raise _err(path, field("constraints"), "expected a list of expressions")
    for i, c in enumerate(constraints_raw):
        if not isinstance(c, str):
            raise _err(path, f"{field('constraints')}[{i}]", f"expected an expression string, got {c!r}")
        try:  # refused here, when the spec is loaded, if it is anything but a plain expression
            safe_expr.check(c)
        except safe_expr.ExprError as exc:
            raise _err(path, f"{field('constraints')}[{i}]", f"{exc} in {clip_text(repr(c), 200)}") from None

    module = load_kernel_module(kernel, path) if import_kernel else None
    known_params = dict(getattr(module, "PARAMS", {}) or {}) if module is not None else None
    if module is not None:
        supported = getattr(module, "WORLD_SIZES", None)
        for w in ws_list:
            if w == 1:
                continue
            if not supported:
                raise _err(path, field("world_size"), f"{w}: {kernel} declares no WORLD_SIZES, so it runs in one "
                           "process only; use 1 (a multi-GPU kernel module lists the world sizes it supports)")
            if w not in tuple(supported):
                raise _err(path, field("world_size"), f"{w}: {kernel} supports world sizes "
                           f"{', '.join(map(str, supported))} (its WORLD_SIZES)")

    defaults = data.get("defaults", {}) or {}
    if not isinstance(defaults, Mapping):
        raise _err(path, field("defaults"), "expected a mapping of parameter: value")
    for k, v in defaults.items():
        _check_param_name(k, known_params, kernel, path, f"{field('defaults')}.{k}")
        _check_scalar(v, path, f"{field('defaults')}.{k}")

    studies = _parse_grid(data.get("grid"), path, field("grid"), known_params, kernel, set(shapes))
    n_points = repeats * len(dtypes) * sum(len(st.configs) * math.prod(map(len, st.params.values()))
                                           * sum(len(shapes[n]) for n in (st.shape_sets or shapes)) for st in studies)
    if n_points > MAX_POINTS:  # checked before anything is expanded
        raise _err(path, field("grid"), f"{n_points:,} points (shapes x dtypes x configs x params x repeats); at "
                   f"most {MAX_POINTS:,} per spec: split the sweep or narrow the grid")

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
                baselines=list(baselines_raw), quick=quick, module=module, **timeouts)
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
                if not vs:
                    raise _err(path, f"{where}[{i}].{k}", "expected a value or a non-empty list of values, got []")
                for x in vs:
                    problem = _shape_value_problem(x)
                    if problem:
                        raise _err(path, f"{where}[{i}].{k}",
                                   f"{x!r}{f' in {v!r}' if isinstance(v, list) else ''}: {problem}; expected a "
                                   "number >= 0 (a size, a ratio), a name (text) or a list of them")
                keys.append(k)
                values.append(vs)
            if len(expanded) + math.prod(map(len, values)) > MAX_POINTS:
                raise _err(path, f"{where}[{i}]", f"expands to more than {MAX_POINTS:,} shapes; split the sweep")
            for combo in itertools.product(*values):
                expanded.append(dict(zip(keys, combo)))
        out[str(set_name)] = expanded
    return out


def _shape_value_problem(x) -> str | None:
    """Why ``x`` cannot be one value of a shape field (None when it can).

    A shape field is a size (an integer >= 0), another number (a ratio, a
    skew: finite, >= 0) or a name (non-empty text, e.g. a routing or a model).
    Each value becomes a cell of the row and part of the seed, so no nesting,
    and no bool or null: YAML's yes/no/~ are more likely slips than meant.
    """
    if isinstance(x, bool) or x is None:
        return f"{'a bool' if isinstance(x, bool) else 'null'} is neither a number nor a name"
    if isinstance(x, (list, tuple)):
        return "lists do not nest"
    if isinstance(x, Mapping):
        return "a mapping is not a value"
    if isinstance(x, str):
        return None if x.strip() else "empty text is not a name"
    if isinstance(x, (int, float)):
        return None if math.isfinite(x) and x >= 0 else "a negative or non-finite number"
    return f"a {type(x).__name__} is neither a number nor a name"


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


def _module_root(kernel: str, path) -> Path | None:
    """Where ``python -m`` would find the spec's kernel module when the import path does not:
    the working directory, or the nearest folder above the spec from which the dotted name
    leads to a file (``tests.cluster.toy`` from ``tests/cluster/toy.yaml``: the folder holding
    ``tests/``). None when it is importable as is, or found nowhere."""
    top = kernel.split(".", 1)[0]
    try:
        if importlib.util.find_spec(top) is not None:
            return None
    except (ImportError, ValueError):
        return None
    rel = Path(*kernel.split("."))
    starts = [Path.cwd().resolve()] + (list(Path(path).resolve().parents) if path else [])
    for root in starts:
        if (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file():
            return root
    return None


def _kernel_module_allowed(kernel: str, root: Path | None = None) -> bool:
    """Whether the spec's module is this project's code (or a package the user allowed).

    Importing runs a module's code, and a shared spec could name any module
    on the path (``antigravity`` opens a browser). Only the top package is
    located (``find_spec`` of a top-level name imports nothing): it must lie
    under the current directory, this repository or ``root`` (the folder the spec's own
    location led to, ``_module_root``), or be listed in $WORKBENCH_KERNEL_PACKAGES
    (comma-separated, e.g. ``mykernels``).
    """
    top = kernel.split(".", 1)[0]
    if top in {p.strip() for p in os.environ.get("WORKBENCH_KERNEL_PACKAGES", "").split(",")}:
        return True
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return True  # let the import itself report it
    if found is None:
        return True
    where = list(found.submodule_search_locations or []) + ([found.origin] if found.origin else [])
    roots = [Path.cwd().resolve(), Path(__file__).resolve().parents[1]] + ([root] if root else [])
    return any(Path(w).resolve().is_relative_to(r) for w in where if os.path.isabs(w) for r in roots)


def load_kernel_module(kernel: str, path):
    root = _module_root(kernel, path)
    if root is not None and str(root) not in sys.path:
        sys.path.insert(0, str(root))   # a console script's path lacks the working directory python -m adds
        importlib.invalidate_caches()
    if not _kernel_module_allowed(kernel, root):
        raise _err(path, "kernel", f"{kernel!r} is not a module of this project (under the current directory or "
                   "the workbench repository), so the spec may not import it; if it is your kernel package, "
                   "name its top package in $WORKBENCH_KERNEL_PACKAGES")
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
def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _constraint_namespace(spec: Spec, shape: dict, dtype: str, params: dict) -> dict:
    ns = dict(shape)
    ns.update(params)
    ns["dtype"] = dtype
    derived = getattr(spec.module, "derived", None) if spec.module is not None else None
    if callable(derived):
        ns.update(derived(shape, torch_dtype(dtype), params))
    return ns


def _satisfies(spec: Spec, shape: dict, dtype: str, params: dict) -> bool:
    if not spec.constraints:
        return True
    ns = _constraint_namespace(spec, shape, dtype, params)
    for i, c in enumerate(spec.constraints):
        try:
            ok = safe_expr.evaluate(c, ns)
        except safe_expr.ExprError as exc:
            raise _err(spec.path, f"constraints[{i}]", f"{exc} in {c!r} for shape {shape} and params {params} "
                       f"(names: {', '.join(sorted(ns))})") from None
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
