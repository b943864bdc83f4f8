"""Where each instruction of a compiled stage came from: the location records of every stage.

Parsers behind `workbench.asm.lines` (read its docstring for the records each
stage carries). Each returns a list of `LineInstr`: the instruction's line in the
stage text, its class (the `workbench.asm.isa` vocabulary), and the source frames
it came from, innermost first (an inlined helper's own line, then its call sites).

Input is untrusted text: regexes only, alias chains bounded, nothing evaluated.
"""
from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass

from . import isa as _isa

_OTHER = ("other", None, None, None)
UNKNOWN_FILE = "<unknown file>"  # a location whose file record is missing


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
_ALLOC_INIT = re.compile(r"\s*%")


def mlir_instrs(text: str, stage: str) -> list[LineInstr]:
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
        if mn == "ttg.local_alloc" and _ALLOC_INIT.match(line, m.end()):  # allocated with a value: a store
            cat, space, kind = "memory", "shared", "store"
        out.append(_instr(stage, no, mn, (cat, space, kind, None), frames))
    return out


# Triton's own library (tl.zeros, tl.cdiv, ...): its lines are not the user's, so an
# instruction made there is attributed to the user's call site.
_LIBRARY = re.compile(r"[/\\]triton[/\\](?:language|experimental)[/\\]")


def _instr(stage, no, mn, cls, frames) -> LineInstr:
    while len(frames) > 1 and frames[0][0] and _LIBRARY.search(frames[0][0]):
        frames = frames[1:]
    if frames and frames[0][1] > 0:
        f, ln = frames[0][0] or UNKNOWN_FILE, frames[0][1]
        via = tuple((fr[0] or UNKNOWN_FILE, fr[1]) for fr in frames[1:] if fr[1] > 0)
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


def llvm_instrs(text: str, stage: str) -> list[LineInstr]:
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
            found = [(_OTHER, first[0] if first else "?")]
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


def directive_locs(text: str) -> tuple[list[int], list[tuple]]:
    """Text line numbers of the .loc directives and the frames each one sets."""
    files = _asm_files(text)
    by_base = {}
    for f in files.values():
        by_base.setdefault(os.path.basename(f), f)
    nos, frames = [], []
    for no, line in enumerate(text.splitlines(), 1):  # numbered as isa.parse numbers them
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


def directive_instrs(text: str, stage: str) -> list[LineInstr]:
    isa = _isa.isa_of_stage(stage)
    nos, frames = directive_locs(text)
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


def sass_instrs(text: str, line_map: dict, callsites: dict) -> list[LineInstr]:
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


def ptx_callsites(ptx: str) -> dict[tuple, tuple]:
    """{(file, line): call-site frames} for helper lines that PTX shows called from one place only."""
    seen: dict[tuple, set] = {}
    for fr in directive_locs(ptx)[1]:
        if fr:
            seen.setdefault(fr[0][:2], set()).add(fr[1:])
    return {k: next(iter(v)) for k, v in seen.items() if len(v) == 1 and next(iter(v))}
