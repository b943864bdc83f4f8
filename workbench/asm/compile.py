"""Cross-compile a Triton or Gluon kernel for GPUs that are not present.

Triton's own compiler does the work (`triton.compile(ASTSource, target=...)`):
no GPU is needed, and the result lands in a cache directory of your choice,
where `workbench.asm` reads it like any other entry.
"""
from __future__ import annotations

import ast
import base64
import importlib
import subprocess
import sys
import os
from pathlib import Path

import json

from .cache import SIDECAR, CacheError, Entry, read_entry

# name -> (backend, arch, warp size)
TARGETS = {
    "sm80": ("cuda", 80, 32),
    "sm89": ("cuda", 89, 32),
    "sm90": ("cuda", 90, 32),
    "sm100": ("cuda", 100, 32),
    "sm120": ("cuda", 120, 32),
    "gfx90a": ("hip", "gfx90a", 64),
    "gfx942": ("hip", "gfx942", 64),
    "gfx950": ("hip", "gfx950", 64),
    "gfx1100": ("hip", "gfx1100", 32),
    "gfx1200": ("hip", "gfx1200", 32),
}


def _target_key(name: str) -> str:
    key = name.lower().replace("_", "")
    if key not in TARGETS:
        raise CacheError(f"unknown target {name!r}: choose one of {', '.join(TARGETS)}")
    return key


def gpu_target(name: str):
    """Triton's GPUTarget for a target name such as 'sm90' or 'gfx942'."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*TARGETS[_target_key(name)])


def warp_size(name: str) -> int:
    """Threads per warp (wavefront) on a target: 32 on NVIDIA and RDNA, 64 on CDNA ('gfx942')."""
    return TARGETS[_target_key(name)][2]


def resolve_function(spec: str):
    """`package.module:function` -> the jitted function (importing the module runs its code)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CacheError(f"{spec!r}: give the kernel as MODULE:FUNCTION, e.g. kernels.comm.isa_hints:remote_store")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CacheError(f"cannot import {module_name!r} ({exc}); is it on PYTHONPATH / installed?") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise CacheError(f"module {module_name!r} has no {attr!r}") from None


def _interpreted(fn) -> bool:
    """True for functions that TRITON_INTERPRET=1 turned into InterpretedFunction."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


def _import_spec(fn) -> str:
    """MODULE:QUALNAME of a jitted function, for a child process to import it."""
    inner = getattr(fn, "fn", fn)
    module, name = getattr(inner, "__module__", None), getattr(inner, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise CacheError(
            f"{name or fn!r}: TRITON_INTERPRET=1 is set, so this kernel can only be cross-compiled from an "
            "importable module; move it into a module, or unset TRITON_INTERPRET"
        )
    return f"{module}:{name}"


def _compile_in_child(fn, targets, request: dict) -> list[Entry]:
    """Cross-compile in a fresh process without the interpreter.

    Under TRITON_INTERPRET=1 every @triton.jit (Triton's own library too) is an
    interpreter object that the compiler cannot lower; a child process that
    imports the kernel with the interpreter off compiles it normally.
    """
    request = dict(request, function=_import_spec(fn), targets=list(targets),
                   attrs=[[list(k), v] for k, v in (request.get("attrs") or {}).items()])
    try:
        payload = json.dumps(request)
    except TypeError as exc:
        raise CacheError(f"under TRITON_INTERPRET=1 constexprs must be plain values to pass on ({exc})") from None
    # The child sees the modules this process sees (pytest and notebooks extend sys.path).
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-m", "workbench.asm.compile"], input=payload, env=env,
                          capture_output=True, text=True, cwd=os.getcwd())
    try:
        reply = json.loads(proc.stdout)
    except json.JSONDecodeError:
        tail = proc.stderr.strip().splitlines()[-3:]
        raise CacheError(f"the compile process failed (exit {proc.returncode}): {' '.join(tail)}") from None
    if "error" in reply:
        raise CacheError(reply["error"])
    return [read_entry(p) for p in reply["entries"]]


def _is_jit(fn) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(fn, JITFunction)


def _is_gluon(fn) -> bool:
    return bool(getattr(fn, "is_gluon", lambda: False)())


def make_signature(fn, types: dict[str, str] | None, constexprs: dict | None) -> dict[str, str]:
    """Full signature: given types, 'constexpr' for constexpr parameters; error on gaps."""
    types = dict(types or {})
    constexprs = dict(constexprs or {})
    sig = {}
    missing = []
    for p in fn.params:
        if p.name in types:
            _check_type(p.name, types[p.name])
            sig[p.name] = types[p.name]
        elif p.is_constexpr or p.name in constexprs:
            sig[p.name] = "constexpr"
        else:
            missing.append(p.name)
    unknown = set(types) - set(sig) | (set(constexprs) - set(sig))
    if unknown:
        raise CacheError(f"{fn.__name__} has no parameter(s) {', '.join(sorted(unknown))}; it takes {', '.join(fn.arg_names)}")
    if missing:
        raise CacheError(
            f"{fn.__name__}: give a type for {', '.join(missing)} (e.g. --arg {missing[0]}=*fp16 or i32)"
        )
    return sig


_LAYOUTS = ("NVMMASharedLayout", "PaddedSharedLayout", "SwizzledSharedLayout")


def _check_type(param: str, ty) -> None:
    """Refuse a type Triton would run as code.

    Triton's ``str_to_ty`` passes the layout of a Gluon ``tensordesc<...>``
    type to ``eval``; only a layout constructor with literal arguments gets
    through here (the layout part is cut out exactly as Triton cuts it).
    """
    if not isinstance(ty, str):
        raise CacheError(f"--arg {param}: a type is text such as *fp16 or i32, got {type(ty).__name__}")
    if not ty.startswith("tensordesc") or "<" not in ty or "[" not in ty.split("<")[1]:
        return
    layout = ty.split("<")[1].rstrip(">").split("[", 1)[1].partition("]")[2].lstrip(",")
    if not layout:
        return
    try:
        call = ast.parse(layout, mode="eval").body
        ok = isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in _LAYOUTS
        for node in call.args + [k.value for k in call.keywords] if ok else ():
            ast.literal_eval(node)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        ok = False
    if not ok:
        raise CacheError(f"--arg {param}: the layout in {ty[:120]!r} must be one of {', '.join(_LAYOUTS)} called "
                         "with literal arguments, e.g. NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, "
                         "rank=2)")


def _attrs(fn, divisible: list | None) -> dict:
    """Pointer/integer alignment attributes: `tt.divisibility = 16` on the named/indexed args."""
    attrs = {}
    for d in divisible or []:
        idx = d if isinstance(d, int) else fn.arg_names.index(d) if d in fn.arg_names else None
        if idx is None:
            raise CacheError(f"{fn.__name__} has no parameter {d!r} to mark divisible")
        attrs[(idx,)] = [["tt.divisibility", 16]]
    return attrs


def _write_sidecar(path: Path, target: str, sig: dict, constexprs, attrs: dict, opts: dict) -> None:
    """Record the call that made an entry, so groups can show constexprs by name."""
    record = {"target": target, "signature": sig,
              "constexprs": {k: repr(v) if not isinstance(v, (int, float, bool, str)) else v
                             for k, v in (constexprs or {}).items()},
              "attrs": {str(list(k)): v for k, v in attrs.items()}, "options": opts}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)  # atomic: readers never see half a file


def _entry_dir(cache: Path, hash_hex: str) -> Path:
    # Triton names an entry by the base32 of its hash (triton.runtime.cache).
    return cache / base64.b32encode(bytes.fromhex(hash_hex)).decode().rstrip("=")


def cross_compile(
    fn,
    targets: list[str] | str,
    *,
    signature: dict[str, str] | None = None,
    constexprs: dict | None = None,
    divisible: list | None = None,
    attrs: dict | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    options: dict | None = None,
    cache_dir: str | os.PathLike,
) -> list[Entry]:
    """Compile `fn` for each target into `cache_dir`; return the new entries.

    `signature` maps non-constexpr parameters to Triton types ('*fp16', 'i32');
    `divisible` names (or indexes) parameters that are 16-byte aligned, which is
    what `tt.divisibility` tells the compiler; `attrs` passes raw attributes.
    """
    import triton
    from triton.compiler import ASTSource

    if isinstance(fn, str):
        fn = resolve_function(fn)
    if isinstance(targets, str):
        targets = [targets]
    gpu_targets = [gpu_target(t) for t in targets]  # validate all names before compiling any
    if _interpreted(fn):
        return _compile_in_child(fn, targets, dict(
            signature=signature, constexprs=constexprs, divisible=divisible, attrs=attrs,
            num_warps=num_warps, num_stages=num_stages, options=options, cache_dir=str(cache_dir)))
    if not _is_jit(fn):
        raise CacheError(f"{fn!r} is not a @triton.jit or @gluon.jit function")
    sig = make_signature(fn, signature, constexprs)
    all_attrs = {**_attrs(fn, divisible), **(attrs or {})}
    opts = dict(options or {})
    if num_warps is not None:
        opts["num_warps"] = num_warps
    if num_stages is not None:
        opts["num_stages"] = num_stages
    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    if _is_gluon(fn):
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        Source = ASTSource
    entries = []
    with triton.knobs.cache.scope():
        triton.knobs.cache.dir = str(cache)
        for name, target in zip(targets, gpu_targets):
            src = Source(fn=fn, signature=sig, constexprs=dict(constexprs or {}), attrs=all_attrs)
            try:
                kernel = triton.compile(src, target=target, options=dict(opts))
            except Exception as exc:  # compiler errors carry the kernel source location
                raise CacheError(f"compiling {fn.__name__} for {name} failed: {exc}") from exc
            path = _entry_dir(cache, kernel.metadata.hash)
            _write_sidecar(path / f"{kernel.metadata.name}{SIDECAR}", name, sig, constexprs, all_attrs, opts)
            entries.append(read_entry(path))
    return entries


def _child_main() -> None:
    """`python -m workbench.asm.compile` < request.json: the child side of _compile_in_child."""
    req = json.load(sys.stdin)
    req["attrs"] = {tuple(k): v for k, v in req.pop("attrs")}
    fn, targets = req.pop("function"), req.pop("targets")
    try:
        reply = {"entries": [str(e.path) for e in cross_compile(fn, targets, **req)]}
    except CacheError as exc:
        reply = {"error": str(exc)}
    print(json.dumps(reply))


if __name__ == "__main__":
    _child_main()
