"""Cross-compile a Triton or Gluon kernel for GPUs that are not present.

Triton's own compiler does the work (`triton.compile(ASTSource, target=...)`):
no GPU is needed, and the result lands in a cache directory of your choice,
where `workbench.asm` reads it like any other entry.
"""
from __future__ import annotations

import base64
import importlib
import types
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


def gpu_target(name: str):
    """Triton's GPUTarget for a target name such as 'sm90' or 'gfx942'."""
    from triton.backends.compiler import GPUTarget

    key = name.lower().replace("_", "")
    if key not in TARGETS:
        raise CacheError(f"unknown target {name!r}: choose one of {', '.join(TARGETS)}")
    return GPUTarget(*TARGETS[key])


def resolve_function(spec: str):
    """`package.module:function` -> the jitted function (importing the module runs its code)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CacheError(f"{spec!r}: give the kernel as MODULE:FUNCTION, e.g. kernels.isa_hints:remote_store")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CacheError(f"cannot import {module_name!r} ({exc}); is it on PYTHONPATH / installed?") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise CacheError(f"module {module_name!r} has no {attr!r}") from None


def _as_jit(fn, _done: dict | None = None):
    """A JITFunction for `fn`, also when the interpreter replaced it (TRITON_INTERPRET=1).

    Under the interpreter, @jit yields InterpretedFunction objects, which the
    compiler cannot lower; so rebuild the function, and every jitted helper it
    calls through its globals, as JITFunctions sharing one new globals dict.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    if not isinstance(fn, InterpretedFunction):
        raise CacheError(f"{fn!r} is not a @triton.jit or @gluon.jit function")
    done = {} if _done is None else _done
    if id(fn) in done:
        return done[id(fn)]
    py = fn.fn
    env = dict(py.__globals__)
    clone = types.FunctionType(py.__code__, env, py.__name__, py.__defaults__, py.__closure__)
    clone.__kwdefaults__, clone.__qualname__, clone.__module__ = py.__kwdefaults__, py.__qualname__, py.__module__
    clone.__annotations__ = py.__annotations__
    # (@gluon.jit never goes through the interpreter, so only plain JITFunctions are rebuilt.)
    done[id(fn)] = jit = JITFunction(clone)
    for name, value in list(env.items()):
        if isinstance(value, InterpretedFunction):
            env[name] = _as_jit(value, done)
    return jit


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
    fn = _as_jit(fn)
    if isinstance(targets, str):
        targets = [targets]
    gpu_targets = [gpu_target(t) for t in targets]  # validate all names before compiling any
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
