"""Which line of my kernel made this instruction? Source-line attribution for every stage.

Each stage carries locations in its own way; this module reads them all, offline:

``source`` / ``ttir`` / ``ttgir``
    MLIR locations: ``loc("file":L:C)`` inline or through ``#locN`` aliases,
    ``loc("name"(...))``, ``loc(callsite(CALLEE at CALLER))`` for an inlined
    ``@triton.jit`` helper, ``loc(fused[...])``.
``llir``
    ``!dbg !N`` -> ``!DILocation(line:, column:, scope:, inlinedAt:)`` whose
    scope (``DISubprogram`` / ``DILexicalBlockFile``) names the ``DIFile``.
``ptx`` / ``amdgcn``
    ``.file N "path"`` and ``.loc N L C`` (``inlined_at`` when present, else the
    ``@[ file:L:C ]`` comment LLVM writes after the directive).
``sass``
    the cubin's line table, through ``nvdisasm -gi`` (offline, the binary the
    Triton wheel ships); matched to ``cuobjdump -sass`` (the text the mix
    counts) by instruction address. The line table does not record inlining,
    so the call site of a helper's line is taken from the PTX when it is unique.

Every instruction gets the innermost (file, line) -- a helper's own line -- and
its chain of call sites (``via``). Line 0 (LLVM's "compiler-generated") and
missing locations give ``line=None``. Classes come from ``workbench.asm.isa``
(PTX/SASS/AMDGCN, and the PTX inside LLIR ``asm`` strings); IR ops and LLVM
loads/stores get the same (category, space, kind, width_bits) vocabulary.

Per-line counts sum to the whole-stage mix (``isa.mix``) by construction: the
same instruction lines are classified, each attributed once.
"""
from __future__ import annotations

import bisect
import os
import re
import stat
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pandas as pd

from . import isa as _isa

__all__ = [
    "LINE_STAGES",
    "LineInstr",
    "Attribution",
    "attribute",
    "entry_lines",
    "line_table",
    "source_view",
    "diff_by_line",
    "read_source",
    "NO_LINE_INFO",
]

LINE_STAGES = ("source", "ttir", "ttgir", "llir", "ptx", "sass", "amdgcn")
SOURCE_LIMIT = 4 << 20  # bytes of a kernel source file we are willing to read
NO_LINE_INFO = (
    "this {stage} carries no line info: the kernel was compiled with TRITON_DISABLE_LINE_INFO=1 "
    "(or by a toolchain that drops it); unset TRITON_DISABLE_LINE_INFO and recompile (clear the entry "
    "or use a fresh cache) to map instructions to source lines"
)
TABLE_COLUMNS = ["file", "line", "via", "stage", "category", "space", "kind", "width_bits", "count", "mnemonics"]

Frame = tuple  # (file, line, col)


@dataclass(frozen=True)
class LineInstr:
    """One instruction (or IR op) of a stage and the source line it came from."""

    stage: str
    text_line: int  # 1-based line in the stage text
    mnemonic: str
    category: str
    space: str | None
    kind: str | None
    width_bits: int | None
    file: str | None  # innermost source file (a helper's own file for inlined code)
    line: int | None  # None: no location, or line 0 (compiler-generated)
    via: tuple = ()  # call sites (file, line), innermost first


@dataclass
class Attribution:
    stage: str
    instrs: list[LineInstr]
    line_info: bool
    note: str | None = None  # why there is no line info, and what to do
    files: list[str] = field(default_factory=list)
    text: str = field(default="", repr=False)  # the stage text the instructions' text_line index


# ---------------------------------------------------------------------------
# reading kernel sources (untrusted paths recorded in the IR)


def read_source(path: str, limit: int = SOURCE_LIMIT) -> tuple[list[str] | None, str | None]:
    """(lines, None) of a kernel source file named by a recorded location, or (None, why not).

    The one place where this module opens a file a location names: regular files
    only (no symlinks, devices or FIFOs), at most `limit` bytes; errors come back
    as a message, never raised. A path from another checkout is looked up by its
    tail under the working and repository directories.
    """
    from .cache import _find_source_file

    try:
        p = _find_source_file(path)
        st = os.lstat(p)
    except (OSError, ValueError) as exc:
        return None, f"{path}: not readable here ({exc.__class__.__name__}); compiled on another machine?"
    if not stat.S_ISREG(st.st_mode):
        return None, f"{p}: not a regular file; not read"
    if st.st_size > limit:
        return None, f"{p}: {st.st_size} bytes, over the {limit >> 20} MiB a kernel source may have; not read"
    return _read_capped(str(p), st.st_mtime_ns, st.st_size, limit)


@lru_cache(maxsize=64)
def _read_capped(path: str, _mtime: int, _size: int, limit: int):
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None, f"{path}: not a regular file; not read"
            data = fh.read(limit + 1)
    except OSError as exc:
        return None, f"{path}: cannot read ({exc.strerror or exc})"
    if len(data) > limit:
        return None, f"{path}: grew past {limit >> 20} MiB while reading; not read"
    return data.decode("utf-8", errors="replace").splitlines(), None


# ---------------------------------------------------------------------------
# MLIR (source / ttir / ttgir)

_MLIR_ALIAS = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$", re.M)
_MLIR_OP = re.compile(r'^\s*(?:%[^=]*?=\s*)?"?([a-z_][a-z0-9_]*\.[a-z0-9_.]+)"?[ (<{]')
_MLIR_FILELOC = re.compile(r'"((?:[^"\\]|\\.)*)":(\d+):(\d+)')


def _split_top(s: str, sep: str) -> list[str]:
    """Split `s` at `sep` outside parentheses, brackets and strings."""
    out, depth, start, i, n = [], 0, 0, 0, len(s)
    while i < n:
        c = s[i]
        if c == '"':
            j = i + 1
            while j < n and s[j] != '"':
                j += 2 if s[j] == "\\" else 1
            i = j + 1
            continue
        if c in "([<{":
            depth += 1
        elif c in ")]>}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            out.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    out.append(s[start:])
    return out


class _MlirLocs:
    """Resolve MLIR location expressions to frames, innermost first."""

    def __init__(self, text: str):
        self.alias = dict(_MLIR_ALIAS.findall(text))
        self.memo: dict[str, tuple] = {}

    def frames(self, expr: str, depth: int = 0) -> tuple:
        expr = expr.strip()
        if depth > 64:  # a cycle in hostile input
            return ()
        if expr.startswith("#loc"):
            hit = self.memo.get(expr)
            if hit is None:
                self.memo[expr] = ()  # guards cycles
                hit = self.memo[expr] = self.frames(self.alias.get(expr, "unknown"), depth + 1)
            return hit
        if expr.startswith("callsite("):
            parts = _split_top(expr[len("callsite("):-1], " at ")
            if len(parts) == 2:
                return self.frames(parts[0], depth + 1) + self.frames(parts[1], depth + 1)
            return ()
        if expr.startswith("fused"):
            body = expr[expr.find("[") + 1:expr.rfind("]")]
            for part in _split_top(body, ","):
                f = self.frames(part, depth + 1)
                if f:
                    return f
            return ()
        if expr.startswith('"'):
            m = _MLIR_FILELOC.match(expr)
            if m:
                return ((m.group(1), int(m.group(2)), int(m.group(3))),)
            k = expr.find("(")  # a name location: "name"(inner)
            return self.frames(expr[k + 1:-1], depth + 1) if k > 0 and expr.endswith(")") else ()
        return ()  # unknown


def _trailing_loc(line: str) -> str | None:
    """The `loc(...)` expression that ends an op line, without `loc(` and `)`."""
    s = line.rstrip()
    if not s.endswith(")"):
        return None
    depth = 0
    for i in range(len(s) - 1, -1, -1):
        c = s[i]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
            if depth == 0:
                return s[i + 1:-1] if s[max(0, i - 3):i] == "loc" else None
    return None


# IR op -> (category, space, kind). Widths are not in the op (they come from the
# layout), so IR rows say None.
_IR_OPS = {
    "tt.load": ("memory", "global", "load"),
    "tt.store": ("memory", "global", "store"),
    "tt.atomic_rmw": ("memory", "global", "atomic"),
    "tt.atomic_cas": ("memory", "global", "atomic"),
    "tt.descriptor_load": ("memory", "tensor", "load"),
    "tt.descriptor_store": ("memory", "tensor", "store"),
    "tt.descriptor_gather": ("memory", "tensor", "load"),
    "tt.descriptor_scatter": ("memory", "tensor", "store"),
    "tt.descriptor_reduce": ("memory", "tensor", "atomic"),
    "ttg.local_load": ("memory", "shared", "load"),
    "ttg.local_store": ("memory", "shared", "store"),
    "ttg.async_copy_global_to_local": ("memory", "global", "async_copy"),
    "ttng.async_tma_copy_global_to_local": ("memory", "tensor", "async_copy"),
    "ttng.async_tma_copy_local_to_global": ("memory", "tensor", "async_copy"),
    "ttng.async_tma_reduce": ("memory", "tensor", "atomic"),
    "ttng.async_tma_gather": ("memory", "tensor", "async_copy"),
    "ttng.async_tma_scatter": ("memory", "tensor", "async_copy"),
    "ttng.tmem_load": ("memory", "tmem", "load"),
    "ttng.tmem_store": ("memory", "tmem", "store"),
    "amdgpu.buffer_load": ("memory", "buffer", "load"),
    "amdgpu.buffer_store": ("memory", "buffer", "store"),
    "amdgpu.buffer_atomic_rmw": ("memory", "buffer", "atomic"),
    "amdgpu.buffer_load_to_local": ("memory", "buffer", "async_copy"),
    "tt.dot": ("matrix", None, None),
    "tt.dot_scaled": ("matrix", None, None),
    "ttng.warp_group_dot": ("matrix", None, None),
    "ttng.tc_gen5_mma": ("matrix", None, None),
    "ttng.tc_gen5_mma_scaled": ("matrix", None, None),
    "gpu.barrier": ("barrier", None, None),
    "ttg.barrier": ("barrier", None, None),
    "ttng.arrive_barrier": ("barrier", None, None),
    "ttng.barrier_expect": ("barrier", None, None),
    "ttng.wait_barrier": ("wait", None, None),
    "ttg.async_wait": ("wait", None, None),
    "ttng.warp_group_dot_wait": ("wait", None, None),
    "ttng.async_tma_store_wait": ("wait", None, None),
}
_IR_SKIP = ("tt.func", "tt.return", "module", "scf.yield")


def _mlir_instrs(text: str, stage: str) -> list[LineInstr]:
    locs = _MlirLocs(text)
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            continue
        m = _MLIR_OP.match(line)
        if m is None:
            continue
        mn = m.group(1)
        if mn.startswith(_IR_SKIP):
            continue
        loc = _trailing_loc(line)
        frames = locs.frames(loc) if loc is not None else ()
        cat, space, kind = _IR_OPS.get(mn, ("other", None, None))
        out.append(_instr(stage, no, mn, (cat, space, kind, None), frames))
    return out


# Triton's own library (tl.zeros, tl.cdiv, ...): its lines are not the user's, so an
# instruction made there is attributed to the user's call site.
_LIBRARY = re.compile(r"[/\\]triton[/\\](?:language|experimental)[/\\]")


def _instr(stage, no, mn, cls, frames) -> LineInstr:
    while len(frames) > 1 and frames[0][0] and _LIBRARY.search(frames[0][0]):
        frames = frames[1:]
    if frames and frames[0][1] > 0:
        f, ln = frames[0][0], frames[0][1]
        via = tuple((fr[0], fr[1]) for fr in frames[1:])
    else:
        f, ln, via = (frames[0][0] if frames else None), None, ()
    return LineInstr(stage, no, mn, cls[0], cls[1], cls[2], cls[3], f, ln, via)


# ---------------------------------------------------------------------------
# LLVM IR

_LL_META = re.compile(r"^!(\d+) = (?:distinct )?!(\w+)\((.*)\)\s*$", re.M)
_LL_FIELD = re.compile(r'(\w+): (?:"((?:[^"\\]|\\.)*)"|!(\d+)|(-?\d+))')
_LL_DBG = re.compile(r",? !dbg !(\d+)")
_LL_ASM = re.compile(r'asm (?:sideeffect )?(?:inteldialect )?"((?:[^"\\]|\\.)*)"')
_LL_MEM = re.compile(
    r"^\s*(?:%\S+ = )?(load|store|atomicrmw|cmpxchg)\b(?: volatile| atomic)*"
)
_LL_PTR = re.compile(r"ptr addrspace\((\d+)\)|\bptr\b")
_LL_TYPE = re.compile(r"<(\d+) x (\w+)>|\b(i\d+|half|bfloat|float|double|ptr)\b")
_LL_CALL = re.compile(r"\bcall\b[^@]*@(llvm\.[\w.]+)")
_LL_TYPE_BITS = {"half": 16, "bfloat": 16, "float": 32, "double": 64, "ptr": 64}
_LL_SUFFIX = re.compile(r"\.(v(\d+))?(i|f|bf)(\d+)$")


def _ll_bits(t: str) -> int | None:
    if t in _LL_TYPE_BITS:
        return _LL_TYPE_BITS[t]
    if t.startswith("i") and t[1:].isdigit():
        return int(t[1:])
    return None


class _LlvmLocs:
    def __init__(self, text: str):
        self.meta = {}
        for num, kind, body in _LL_META.findall(text):
            if kind in ("DILocation", "DIFile", "DISubprogram", "DILexicalBlockFile", "DILexicalBlock"):
                fields = {}
                for k, s, ref, n in _LL_FIELD.findall(body):
                    fields[k] = s if s else (("!", int(ref)) if ref else int(n))
                self.meta[int(num)] = (kind, fields)
        self.memo: dict[int, tuple] = {}

    def _file(self, ref, depth=0) -> str | None:
        node = self.meta.get(ref)
        if node is None or depth > 32:
            return None
        kind, f = node
        if kind == "DIFile":
            name, d = f.get("filename", ""), f.get("directory", "")
            return name if not d or name.startswith("/") else f"{d}/{name}"
        fref = f.get("file")
        if isinstance(fref, tuple):
            return self._file(fref[1], depth + 1)
        sref = f.get("scope")
        return self._file(sref[1], depth + 1) if isinstance(sref, tuple) else None

    def frames(self, ref: int, depth: int = 0) -> tuple:
        hit = self.memo.get(ref)
        if hit is not None:
            return hit
        node = self.meta.get(ref)
        if node is None or node[0] != "DILocation" or depth > 64:
            return ()
        self.memo[ref] = ()
        f = node[1]
        scope = f.get("scope")
        file = self._file(scope[1]) if isinstance(scope, tuple) else None
        out = ((file, int(f.get("line", 0)), int(f.get("column", 0))),)
        inl = f.get("inlinedAt")
        if isinstance(inl, tuple):
            out += self.frames(inl[1], depth + 1)
        self.memo[ref] = out
        return out


def _asm_classes(asm: str) -> list[tuple]:
    """(class, mnemonic) of the PTX instructions inside an LLVM inline-asm string."""
    body = asm.replace("\\0A", "\n").replace("\\09", " ").replace("$$", "$")
    body = re.sub(r"\$(\d+)", r"%r\1", body)
    out = []
    for piece in re.split(r"[;\n]", body):
        piece = piece.strip().lstrip("{").strip()
        if not piece:
            continue
        ins = _isa.classify(piece, "ptx")
        if ins is not None and ins.category != "other":
            out.append(((ins.category, ins.space, ins.kind, ins.width_bits), ins.mnemonic))
    return out


def _ll_native(m: re.Match, line: str, backend_amd: bool) -> tuple:
    op = m.group(1)
    kind = {"load": "load", "store": "store"}.get(op, "atomic")
    ptr = _LL_PTR.search(line, m.end())
    space_no = int(ptr.group(1)) if ptr and ptr.group(1) else 0
    spaces = ({1: "global", 3: "shared", 4: "const", 5: "local", 7: "buffer", 8: "buffer"} if backend_amd
              else {1: "global", 3: "shared", 4: "const", 5: "local"})
    space = spaces.get(space_no, "flat" if backend_amd else "generic")
    # The value type: for a load the first type after 'load', for a store the stored value's.
    t = _LL_TYPE.search(line, m.end())
    width = None
    if t:
        if t.group(1):
            b = _ll_bits(t.group(2))
            width = None if b is None else b * int(t.group(1))
        else:
            width = _ll_bits(t.group(3))
    return ("memory", space, kind, width), op


def _ll_intrinsic(name: str) -> tuple | None:
    """Class of a call to an LLVM intrinsic, through the ISA classifiers where one spells it."""
    if name.startswith("llvm.nvvm."):
        ins = _isa.classify(name[len("llvm.nvvm."):], "ptx")
        return None if ins is None or ins.category == "other" else (ins.category, ins.space, ins.kind, ins.width_bits)
    if name.startswith("llvm.amdgcn."):
        rest = name[len("llvm.amdgcn."):]
        if "buffer." in rest and any(k in rest for k in ("load", "store", "atomic")):
            kind = "load" if ".load" in rest else "store" if ".store" in rest else "atomic"
            m = _LL_SUFFIX.search(rest)
            width = None if m is None else int(m.group(4)) * int(m.group(2) or 1)
            return ("memory", "buffer", kind, width)
        if rest.startswith(("mfma", "smfmac", "wmma", "swmmac")):
            return ("matrix", None, None, None)
        ins = _isa.classify(rest.replace(".", "_"), "amdgcn")
        return None if ins is None or ins.category == "other" else (ins.category, ins.space, ins.kind, ins.width_bits)
    return None


def _llvm_instrs(text: str, stage: str) -> list[LineInstr]:
    locs = _LlvmLocs(text)
    amd = "amdgcn" in text[:4096] or "amdgpu_kernel" in text
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.startswith("  ") or line.lstrip().startswith(";"):
            continue
        d = _LL_DBG.search(line)
        frames = locs.frames(int(d.group(1))) if d else ()
        found = []
        a = _LL_ASM.search(line)
        if a:
            found = _asm_classes(a.group(1))
        else:
            m = _LL_MEM.match(line)
            if m:
                found = [_ll_native(m, line, amd)]
            else:
                c = _LL_CALL.search(line)
                cls = _ll_intrinsic(c.group(1)) if c else None
                if cls is not None:
                    found = [(cls, c.group(1))]
        if not found:
            first = line.split("=", 1)[-1].split()
            found = [(_isa._OTHER, first[0] if first else "?")]
        for cls, mn in found:
            out.append(_instr(stage, no, mn, cls, frames))
    return out


# ---------------------------------------------------------------------------
# PTX and AMDGCN: .file / .loc directives

_FILE_DIR = re.compile(r'^\s*\.file\s+(\d+)\s+"((?:[^"\\]|\\.)*)"(?:\s*,?\s*"((?:[^"\\]|\\.)*)")?', re.M)
_LOC_DIR = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+(\d+)([^\n]*)$", re.M)
_INLINED_AT = re.compile(r"inlined_at\s+(\d+)\s+(\d+)\s+(\d+)")
_CALL_COMMENT = re.compile(r"@\[\s*([^\s:\]]+):(\d+):(\d+)")


def _asm_files(text: str) -> dict[int, str]:
    files = {}
    for num, a, b in _FILE_DIR.findall(text):
        files[int(num)] = f"{a.rstrip('/')}/{b}" if b and not b.startswith("/") else (b or a)
    return files


def _directive_locs(text: str) -> tuple[list[int], list[tuple]]:
    """Text line numbers of the .loc directives and the frames each one sets."""
    files = _asm_files(text)
    by_base = {}
    for f in files.values():
        by_base.setdefault(os.path.basename(f), f)
    nos, frames = [], []
    for no, line in enumerate(text.split("\n"), 1):
        if ".loc" not in line:
            continue
        m = _LOC_DIR.match(line)
        if m is None:
            continue
        fnum, ln, col, tail = int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)
        fr = [(files.get(fnum, f"file{fnum}"), ln, col)]
        inl = _INLINED_AT.findall(tail)
        if inl:
            fr += [(files.get(int(a), f"file{a}"), int(b), int(c)) for a, b, c in inl]
        else:
            fr += [(by_base.get(b, b), int(ln2), int(c2)) for b, ln2, c2 in _CALL_COMMENT.findall(tail)]
        nos.append(no)
        frames.append(tuple(fr))
    return nos, frames


def _directive_instrs(text: str, stage: str) -> list[LineInstr]:
    isa = _isa.isa_of_stage(stage)
    nos, frames = _directive_locs(text)
    out = []
    for ins in _isa.parse(text, isa):
        k = bisect.bisect_left(nos, ins.line_no) - 1
        fr = frames[k] if k >= 0 else ()
        out.append(_instr(stage, ins.line_no, ins.mnemonic, (ins.category, ins.space, ins.kind, ins.width_bits), fr))
    return out


# ---------------------------------------------------------------------------
# SASS: the cubin's line table through nvdisasm, joined by address

_NV_FUNC = re.compile(r"^\.text\.([\w$.]+):", re.M)
_NV_LINE = re.compile(r'//## File "((?:[^"\\]|\\.)*)", line (\d+)(?:[^\n]*?inlined at "((?:[^"\\]|\\.)*)", line (\d+))?')
_SASS_ADDR = re.compile(r"/\*([0-9a-fA-F]{4,})\*/")
_CUOBJ_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)", re.M)


def sass_line_map(nvdisasm_text: str) -> dict[tuple, tuple]:
    """{(function, address): frames} from ``nvdisasm -gi`` output."""
    out: dict[tuple, tuple] = {}
    func, cur = "", ()
    for line in nvdisasm_text.splitlines():
        s = line.lstrip()
        if s.startswith("//##"):
            m = _NV_LINE.match(s)
            if m:
                cur = ((m.group(1), int(m.group(2)), 0),)
                if m.group(3):
                    cur += ((m.group(3), int(m.group(4)), 0),)
            continue
        if s.startswith(".text."):
            m = _NV_FUNC.match(s)
            if m:
                func, cur = m.group(1), ()
            continue
        m = _SASS_ADDR.match(s)
        if m and cur:
            out[(func, int(m.group(1), 16))] = cur
    return out


def _sass_instrs(text: str, line_map: dict, callsites: dict) -> list[LineInstr]:
    lines = text.splitlines()
    # The function each instruction line belongs to (cuobjdump prints 'Function : NAME' first).
    func_at = [(no, m.group(1)) for no, line in enumerate(lines, 1) if "Function" in line
               for m in [_CUOBJ_FUNC.match(line)] if m]
    func_nos = [n for n, _ in func_at]
    out = []
    for ins in _isa.parse(text, "sass"):
        raw = lines[ins.line_no - 1]
        m = _SASS_ADDR.search(raw)
        k = bisect.bisect_right(func_nos, ins.line_no) - 1
        func = func_at[k][1] if k >= 0 else ""
        fr = line_map.get((func, int(m.group(1), 16))) if m else None
        if fr is None and m and not func_at:
            fr = line_map.get(("", int(m.group(1), 16)))
        fr = fr or ()
        if len(fr) == 1:  # the line table knows no inlining: borrow the PTX's unique call site
            fr = fr + callsites.get(fr[0][:2], ())
        out.append(_instr("sass", ins.line_no, ins.mnemonic, (ins.category, ins.space, ins.kind, ins.width_bits), fr))
    return out


def _ptx_callsites(ptx: str) -> dict[tuple, tuple]:
    """{(file, line): call-site frames} for helper lines that PTX shows called from one place only."""
    seen: dict[tuple, set] = {}
    for fr in _directive_locs(ptx)[1]:
        if fr:
            seen.setdefault(fr[0][:2], set()).add(fr[1:])
    return {k: next(iter(v)) for k, v in seen.items() if len(v) == 1 and next(iter(v))}


# ---------------------------------------------------------------------------
# public API


def attribute(text: str, stage: str, *, sass_lines: str | None = None, ptx: str | None = None) -> Attribution:
    """Attribute every instruction (or IR op) of `text`, one `stage`'s text, to a source line.

    For ``sass``, `text` is ``cuobjdump -sass`` output (what the mix counts),
    `sass_lines` the ``nvdisasm -gi`` output of the same cubin, `ptx` the
    entry's PTX (for helpers' call sites).
    """
    if stage not in LINE_STAGES:
        raise ValueError(f"stage {stage!r} has no instructions to attribute; choose one of {', '.join(LINE_STAGES)}")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if stage in ("source", "ttir", "ttgir"):
        instrs = _mlir_instrs(text, stage)
    elif stage == "llir":
        instrs = _llvm_instrs(text, stage)
    elif stage == "sass":
        instrs = _sass_instrs(text, sass_line_map(sass_lines or ""), _ptx_callsites(ptx) if ptx else {})
    else:
        instrs = _directive_instrs(text, stage)
    line_info = any(i.line is not None for i in instrs)
    files = sorted({i.file for i in instrs if i.file and i.line is not None}
                   | {f for i in instrs for f, _ in i.via if f})
    note = None if line_info or not instrs else NO_LINE_INFO.format(stage=stage)
    return Attribution(stage, instrs, line_info, note, files, text)


def entry_lines(entry, stage: str | None = None, text: str | None = None) -> Attribution:
    """Attribution of one stage of a cache entry (default: its final assembly).

    `text`: the stage text when the caller has read it already (SASS: the
    ``cuobjdump -sass`` text).
    """
    from .cache import normalize_stage

    stage = normalize_stage(stage or entry.final_stage)
    if stage == "python":
        raise ValueError("the python stage is the source itself; pick a compiled stage: " + ", ".join(LINE_STAGES))
    if stage != "sass":
        return attribute(entry.text(stage) if text is None else text, stage)
    from concurrent.futures import ThreadPoolExecutor

    from .tools import sass_with_lines

    # nvdisasm (line table) and cuobjdump (the text the mix counts) run side by side.
    with ThreadPoolExecutor(1) as pool:
        table = pool.submit(sass_with_lines, entry._stage_path("cubin"))
        text = entry.text("sass") if text is None else text
        ptx = None
        if "ptx" in entry.stages:
            try:
                ptx = entry.text("ptx")
            except Exception:  # the PTX only adds call sites
                ptx = None
        return attribute(text, "sass", sass_lines=table.result(), ptx=ptx)


def instr_text(attr: Attribution, i: LineInstr) -> str:
    """The instruction's line of the stage text, without addresses, encodings and comments."""
    raw = attr.text.split("\n")[i.text_line - 1] if attr.text else ""
    if attr.stage in _isa.ISAS:
        return _isa._clean_text(raw, attr.stage)
    return raw.strip()


def _via_str(via: tuple) -> str:
    return " < ".join(f"{os.path.basename(f)}:{ln}" for f, ln in via)


def line_table(attr: Attribution, include_other: bool = False) -> pd.DataFrame:
    """One row per (file, line, via, instruction class): count and mnemonics.

    Rows of instructions without a line have file/line missing. Counts of the
    memory/matrix/barrier/wait rows sum to the stage's mix table.
    """
    groups: dict[tuple, dict] = {}
    for i in attr.instrs:
        if i.category == "other" and not include_other:
            continue
        key = (i.file if i.line is not None else None, i.line, _via_str(i.via), i.category, i.space, i.kind, i.width_bits)
        g = groups.get(key)
        if g is None:
            g = groups[key] = {}
        g[i.mnemonic] = g.get(i.mnemonic, 0) + 1
    rows = []
    for (f, ln, via, cat, space, kind, width), names in groups.items():
        rows.append({"file": f, "line": ln, "via": via, "stage": attr.stage, "category": cat, "space": space,
                     "kind": kind, "width_bits": width, "count": sum(names.values()),
                     "mnemonics": ", ".join(f"{k}:{v}" for k, v in sorted(names.items(), key=lambda x: (-x[1], x[0])))})
    df = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    if len(df):
        df = df.sort_values(["file", "line", "via", "category", "space", "kind", "width_bits"],
                            key=_sort_key, na_position="last").reset_index(drop=True)
    df["line"] = df["line"].astype("Int64")
    df["width_bits"] = df["width_bits"].astype("Int64")
    return df


def _sort_key(s: pd.Series):
    if s.name in ("line", "width_bits"):
        return pd.to_numeric(s, errors="coerce").fillna(-1)
    return s.fillna("").astype(str)


def class_phrase(space, kind, width, count, category) -> str:
    """'global store 128-bit x2', 'matrix x4', 'barrier x1'."""
    if category != "memory":
        return f"{category} x{count}"
    w = "" if width is None or pd.isna(width) else f" {int(width)}-bit"
    return f"{space or '?'} {kind or '?'}{w} x{count}"


def summarize_line(counts: dict) -> str:
    """The classes of one source line, {(category, space, kind, width): count} -> 'global store 128-bit x2; barrier x1'."""
    keys = sorted(counts, key=lambda k: (k[0], k[1] or "", k[2] or "", -1 if k[3] is None else k[3]))
    return "; ".join(class_phrase(k[1], k[2], k[3], counts[k], k[0]) for k in keys)


def source_view(attr: Attribution, context: int = 0) -> pd.DataFrame:
    """The kernel's source one row per line, with what each line produced.

    Columns: file, line, source (the text, or '' when the file cannot be read),
    instructions (summary of the classes), count (memory/matrix/barrier/wait
    instructions), other (the rest), calls (instructions of inlined helpers
    called from this line). Per file, the rows run from the first to the last
    line that produced anything (and `context` lines beyond); a final row
    with line <NA> holds the instructions with no line.
    """
    own: dict[tuple, dict] = {}  # (file, line) -> {class: count}
    other: dict[tuple, int] = {}
    calls: dict[tuple, int] = {}
    for i in attr.instrs:
        key = (i.file, i.line) if i.line is not None else (None, None)
        if i.category == "other":
            other[key] = other.get(key, 0) + 1
        else:
            c = own.setdefault(key, {})
            cls = (i.category, i.space, i.kind, i.width_bits)
            c[cls] = c.get(cls, 0) + 1
            for site in set(i.via):
                calls[site] = calls.get(site, 0) + 1
    rows = []
    for file in sorted({k[0] for k in (*own, *other, *calls) if k[0] is not None}):
        nums = {ln for f, ln in (*own, *other, *calls) if f == file and ln is not None}
        text, _problem = read_source(file)
        lo, hi = max(1, min(nums) - context), max(nums) + context
        if text is not None:
            hi = max(min(hi, len(text)), max(nums))
        for ln in range(lo, hi + 1):
            c = own.get((file, ln), {})
            rows.append({"file": file, "line": ln, "source": text[ln - 1] if text and ln <= len(text) else "",
                         "instructions": summarize_line(c), "count": sum(c.values()),
                         "other": other.get((file, ln), 0), "calls": calls.get((file, ln), 0)})
    none = (None, None)
    if none in own or none in other:
        c = own.get(none, {})
        what = "compiler-generated or unlocated" if attr.line_info else "no line info"
        rows.append({"file": None, "line": pd.NA, "source": f"(no line: {what})", "instructions": summarize_line(c),
                     "count": sum(c.values()), "other": other.get(none, 0), "calls": 0})
    out = pd.DataFrame(rows, columns=["file", "line", "source", "instructions", "count", "other", "calls"])
    out["line"] = out["line"].astype("Int64")
    return out


def line_instructions(attr: Attribution, line: int, file: str | None = None) -> list[LineInstr]:
    """The instructions of source line `line`: made there, or by a helper called from there."""
    def here(f, ln):
        return ln == line and (file is None or f == file or os.path.basename(f or "") == file)

    return [i for i in attr.instrs if here(i.file, i.line) or any(here(f, ln) for f, ln in i.via)]


# ---------------------------------------------------------------------------
# per-line diff of two entries


def diff_by_line(a: Attribution, b: Attribution) -> pd.DataFrame:
    """Source lines whose instruction mix changed from `a` to `b`.

    Lines are matched by file name (not directory: two checkouts compile the
    same file at different paths) and line number. One row per (line,
    memory space and kind or category): what A had, what B has, e.g.
    ``16 x 16-bit`` -> ``2 x 128-bit``. Only changed lines are returned.
    """
    ta, tb = (_by_base(line_table(x)) for x in (a, b))
    keys = ["base", "line", "category", "space", "kind", "width_bits"]
    merged = pd.merge(ta, tb, on=keys, how="outer", suffixes=("_a", "_b"))
    merged[["count_a", "count_b"]] = merged[["count_a", "count_b"]].fillna(0).astype(int)
    merged["file"] = merged["file_b"].where(merged["file_b"].notna(), merged["file_a"])
    changed = merged[merged["count_a"] != merged["count_b"]][["base", "line"]].drop_duplicates()
    rows = []
    for base, line in changed.itertuples(index=False):
        sel = merged[(merged["base"] == base) & (merged["line"].astype(object) == line)]
        if pd.isna(line):
            sel = merged[(merged["base"] == base) & merged["line"].isna()]
        file = sel["file"].dropna().iloc[0] if sel["file"].notna().any() else None
        src = ""
        if file and not pd.isna(line):
            text, _ = read_source(file)
            src = text[int(line) - 1].strip() if text and int(line) <= len(text) else ""
        for (cat, space, kind), g in sel.groupby(["category", "space", "kind"], dropna=False, sort=True):
            before, after = _widths_phrase(g, "count_a"), _widths_phrase(g, "count_b")
            if before == after:
                continue
            rows.append({"file": file, "line": line, "source": src, "category": cat,
                         "space": None if pd.isna(space) else space, "kind": None if pd.isna(kind) else kind,
                         "count_a": int(g["count_a"].sum()), "count_b": int(g["count_b"].sum()),
                         "a": before, "b": after})
    out = pd.DataFrame(rows, columns=["file", "line", "source", "category", "space", "kind",
                                      "count_a", "count_b", "a", "b"])
    out["line"] = out["line"].astype("Int64")
    return out


def _by_base(t: pd.DataFrame) -> pd.DataFrame:
    t = t.copy()
    t["base"] = [os.path.basename(f) if isinstance(f, str) else "" for f in t["file"]]
    for k in ("space", "kind"):
        t[k] = t[k].astype(object).where(t[k].notna(), "")
    t["width_bits"] = t["width_bits"].astype("float").fillna(-1).astype(int)
    return (t.groupby(["base", "line", "category", "space", "kind", "width_bits"], dropna=False)
            .agg(count=("count", "sum"), file=("file", "first")).reset_index())


def _widths_phrase(g: pd.DataFrame, col: str) -> str:
    """'16 x 16-bit + 4 x 32-bit' (memory) or '4' (others); 'none' when absent."""
    parts = []
    for w, n in sorted(zip(g["width_bits"], g[col]), key=lambda x: x[0]):
        if n:
            parts.append(f"{n} x {w}-bit" if w >= 0 else f"{n}" if g["category"].iloc[0] != "memory"
                         else f"{n} x ?-bit")
    return " + ".join(parts) if parts else "none"


def describe_changes(diff: pd.DataFrame) -> list[str]:
    """One sentence per changed (line, class): 'remote.py:38 `tl.store(...)`: global store 16 x 16-bit -> 2 x 128-bit'."""
    out = []
    for r in diff.itertuples(index=False):
        where = f"{os.path.basename(r.file)}:{r.line}" if r.file and not pd.isna(r.line) else "(no line)"
        what = f"{r.space} {r.kind}" if r.category == "memory" else r.category
        src = f" `{r.source}`" if r.source else ""
        out.append(f"{where}{src}: {what} {r.a} -> {r.b}")
    return out
