"""Instruction classification for PTX, SASS and AMDGCN text.

Every instruction line is put in one of five categories:

``memory``
    moves data: loads, stores, atomics, asynchronous copies, prefetches.
    ``space`` says where (``global``, ``shared``, ``local``, ``const``,
    ``param``, ``generic``, ``tensor`` for TMA, ``tmem``, ``multimem``;
    on AMD also ``buffer``, ``flat`` and ``scalar`` for ``s_load``; LDS is
    ``shared`` and scratch is ``local``), ``kind`` says how (``load``,
    ``store``, ``atomic``, ``async_copy``, ``prefetch``) and ``width_bits``
    how many bits one thread moves with one instruction (``None`` when the
    text does not say, e.g. a TMA copy whose box lives in a descriptor).
``matrix``
    tensor-core / matrix-core math: ``mma``, ``wgmma.mma_async``, ``HMMA``,
    ``HGMMA``, ``v_mfma_*``, ``v_wmma_*`` ...
``barrier``
    thread-block (or warp / cluster) synchronisation: ``bar.sync``,
    ``BAR.SYNC``, ``WARPSYNC``, ``mbarrier.arrive``, ``s_barrier`` ...
``wait``
    waits on outstanding asynchronous work: ``s_waitcnt``,
    ``cp.async.wait_group``, ``wgmma.wait_group``, ``mbarrier.try_wait``,
    ``DEPBAR`` ...
``other``
    everything else (arithmetic, control flow, fences, cache control,
    commit-group markers, cross-lane ``ds_bpermute`` ...).

Counts are static: one per instruction line in the text, whatever its
predicate, except SASS instructions guarded by ``@!PT`` (never executed,
emitted as scoreboard padding), which are ``other``.

``mix`` groups the counts by class (what moves data, and how wide);
``opcodes`` counts every instruction by its opcode, arithmetic and bit
operations included (the byte shuffles a layout costs show up there:
SASS ``PRMT``, AMDGCN ``v_perm_b32``).

This module must stay cheap to import: no torch, no triton.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd

__all__ = [
    "ISAS",
    "CATEGORIES",
    "Instr",
    "parse",
    "classify",
    "tally",
    "mix",
    "opcodes",
    "isa_of_stage",
]

ISAS = ("ptx", "sass", "amdgcn")
CATEGORIES = ("memory", "matrix", "barrier", "wait", "other")
MIX_COLUMNS = ("category", "space", "kind", "width_bits", "count", "bytes_per_thread", "mnemonics")

# A classification: (category, space, kind, width_bits).
_Class = tuple
_OTHER: _Class = ("other", None, None, None)


@dataclass(frozen=True)
class Instr:
    line_no: int  # 1-based line in the text
    text: str  # the instruction, stripped of addresses, encodings and comments
    mnemonic: str  # e.g. 'st.global.v4.b32', 'STG.E.128', 'global_store_dwordx4'
    category: str  # 'memory' | 'matrix' | 'barrier' | 'wait' | 'other'
    space: str | None
    kind: str | None
    width_bits: int | None

    @property
    def bytes(self) -> float | None:
        """Bytes one thread moves with this instruction (None if unknown or not memory)."""
        return None if self.width_bits is None else self.width_bits / 8


def _check_isa(isa: str) -> str:
    if isa not in ISAS:
        raise ValueError(f"unknown ISA {isa!r}; expected one of {', '.join(ISAS)}")
    return isa


def isa_of_stage(stage: str) -> str:
    """The ISA whose text a cache stage holds: 'ptx', 'sass' or 'amdgcn'."""
    if stage in ISAS:
        return stage
    raise ValueError(
        f"stage {stage!r} holds no instruction text this module reads; "
        f"expected one of {', '.join(ISAS)} (a cubin gives 'sass' through "
        "workbench.asm.tools.sass_from_cubin)"
    )


# --------------------------------------------------------------------------
# Line recognisers.  Each one has group 'mn' (the mnemonic); SASS also has
# 'never' (set for an '@!PT' guard).  The same patterns, compiled with
# MULTILINE and a leading newline, drive the whole-text scan in tally().

# Leading blanks, matched atomically (a lookahead and a back-reference: no
# backtracking into them, which matters on SASS encoding lines padded with
# ninety spaces; works on Python 3.10, which lacks possessive quantifiers).
_WS = r"(?=(?P<ws>[ \t]*))(?P=ws)"
_PTX_PRED = r"(?:@!?%?\w+[ \t]+)?"
_PTX_END = r"(?=[ \t;{\r]|$)"
_PTX_LINE = _WS + _PTX_PRED + r"(?P<mn>[a-z][a-z0-9_]*(?:\.[A-Za-z0-9_:]+)*)" + _PTX_END
_SASS_LINE = (
    _WS + r"(?:/\*[0-9a-fA-F]+\*/[ \t]*)?(?:\{[ \t]*)?"
    r"(?:(?P<never>@!U?PT)[ \t]+|@!?U?P[0-9]+[ \t]+|@U?PT[ \t]+)?"
    r"(?P<mn>[A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)(?=[ \t;\r]|$)"
)
_AMD_END = r"(?=[ \t\r]|$)"
_AMD_LINE = _WS + r"(?P<mn>[a-z][a-z0-9_]*)" + _AMD_END

_LINE_RE = {
    "ptx": re.compile(_PTX_LINE),
    "sass": re.compile(_SASS_LINE),
    "amdgcn": re.compile(_AMD_LINE),
}
# Whole-text scanners: anchored on a literal newline, which lets the regex
# engine skip from line to line quickly.  findall() gives tuples (ws, mn), or
# (ws, never, mn) for SASS.
_SCAN_RE = {isa: re.compile("\n" + rx.pattern, re.MULTILINE) for isa, rx in _LINE_RE.items()}

# Trailing comments / encodings to cut from Instr.text.
_SASS_ADDR = re.compile(r"^/\*[0-9a-fA-F]+\*/\s*")
_SASS_TAIL = re.compile(r"\s*/\*.*?\*/\s*$")


def _clean_text(line: str, isa: str) -> str:
    s = line.strip()
    if isa == "sass":
        s = _SASS_ADDR.sub("", s)
        s = _SASS_TAIL.sub("", s)
        s = s.lstrip("{").rstrip("}").strip()
    elif isa == "ptx":
        i = s.find("//")
        if i >= 0:
            s = s[:i].rstrip()
    else:
        i = s.find(";")
        if i >= 0:
            s = s[:i].rstrip()
        i = s.find("//")
        if i >= 0:
            s = s[:i].rstrip()
    return s


# --------------------------------------------------------------------------
# PTX

_PTX_SPACES = {
    "global": "global",
    "shared": "shared",
    "local": "local",
    "const": "const",
    "param": "param",
    "tex": "texture",
}
_PTX_TYPE = re.compile(r"(b|u|s|f|bf|tf)(8|16|32|64|128)(?:x(\d+))?")
_PTX_FP8 = re.compile(r"(?:e4m3|e5m2|e2m3|e3m2|ue8m0)x(\d+)")
# cp.async.{ca,cg} dst, src, cp-size[, src-size]: the cp-size operand.
_PTX_CP_SIZE_TAIL = r"[^\n]*?\][ \t]*,[ \t]*\[[^\]\n]*\][ \t]*,[ \t]*(0x[0-9a-fA-F]+|\d+)"
_PTX_CP_SIZE = re.compile(_PTX_CP_SIZE_TAIL)


def _ptx_space(tokens: list[str], default: str = "generic") -> str:
    for t in tokens:
        base = t.split("::", 1)[0]
        if base in _PTX_SPACES:
            return _PTX_SPACES[base]
    return default


def _ptx_width(tokens: list[str]) -> int | None:
    bits = None
    vec = 1
    for t in tokens:
        if t in ("v2", "v4", "v8"):
            vec = int(t[1:])
            continue
        m = _PTX_TYPE.fullmatch(t)
        if m:
            bits = int(m.group(2)) * (int(m.group(3)) if m.group(3) else 1)
            continue
        m = _PTX_FP8.fullmatch(t)
        if m:
            bits = 8 * int(m.group(1))
    return None if bits is None else bits * vec


@lru_cache(maxsize=4096)
def _ptx_class(mn: str) -> _Class:
    tokens = mn.split(".")
    op = tokens[0]
    rest = tokens[1:]
    if op in ("ld", "ldu", "st"):
        kind = "store" if op == "st" else "load"
        if rest and rest[0] == "async":  # st.async: remote shared memory in a cluster
            return ("memory", "shared", "store", _ptx_width(rest))
        if rest and rest[0] == "bulk":  # st.bulk: zero-fill of shared memory
            return ("memory", "shared", "store", None)
        return ("memory", _ptx_space(rest), kind, _ptx_width(rest))
    if op in ("atom", "red"):
        if rest and rest[0] == "async":
            return ("memory", "shared", "atomic", _ptx_width(rest))
        return ("memory", _ptx_space(rest), "atomic", _ptx_width(rest))
    if op in ("prefetch", "prefetchu"):
        space = "tensor" if "tensormap" in rest else _ptx_space(rest)
        return ("memory", space, "prefetch", None)
    if op == "ldmatrix" or op == "stmatrix":
        n = 1
        for t in rest:
            if t in ("x1", "x2", "x4"):
                n = int(t[1:])
        kind = "load" if op == "ldmatrix" else "store"
        return ("memory", "shared", kind, 32 * n)
    if op == "cp":
        # cp.async.{ca,cg}, cp.async.bulk[.tensor], cp.reduce.async.bulk[.tensor]
        if "wait_group" in rest or "wait_all" in rest:
            return ("wait", None, None, None)
        if "commit_group" in rest:
            return _OTHER
        if "mbarrier" in rest:  # cp.async.mbarrier.arrive
            return ("barrier", None, None, None)
        space = "tensor" if "tensor" in rest else "global"
        if rest and rest[0] == "reduce":
            return ("memory", space, "atomic", None)
        if "prefetch" in rest:
            return ("memory", space, "prefetch", None)
        if rest and rest[0] == "async" and len(rest) > 1 and rest[1] in ("ca", "cg"):
            # The width is the cp-size operand; classify_operands() fills it in.
            return ("memory", "global", "async_copy", None)
        if rest and rest[0] == "async":
            return ("memory", space, "async_copy", None)
        return ("memory", _ptx_space(rest), "async_copy", None)
    if op == "multimem":
        sub = rest[0] if rest else ""
        kind = {"ld_reduce": "load", "st": "store", "red": "atomic"}.get(sub)
        if kind is None:
            return _OTHER
        return ("memory", "multimem", kind, _ptx_width(rest[1:]))
    if op == "tcgen05":
        sub = rest[0] if rest else ""
        if sub == "ld":
            return ("memory", "tmem", "load", None)
        if sub == "st":
            return ("memory", "tmem", "store", None)
        if sub == "cp":
            return ("memory", "tmem", "async_copy", None)
        if sub == "mma":
            return ("matrix", None, None, None)
        if sub == "wait":
            return ("wait", None, None, None)
        return _OTHER
    if op == "wmma":
        sub = rest[0] if rest else ""
        if sub == "mma":
            return ("matrix", None, None, None)
        if sub in ("load", "store"):
            return ("memory", _ptx_space(rest), sub, None)
        return _OTHER
    if op == "mma":
        return ("matrix", None, None, None)
    if op == "wgmma":
        sub = rest[0] if rest else ""
        if sub == "mma_async":
            return ("matrix", None, None, None)
        if sub == "wait_group":
            return ("wait", None, None, None)
        return _OTHER  # wgmma.fence, wgmma.commit_group
    if op in ("bar", "barrier"):
        return ("barrier", None, None, None)
    if op == "mbarrier":
        sub = rest[0] if rest else ""
        if sub in ("try_wait", "test_wait"):
            return ("wait", None, None, None)
        if sub.startswith("arrive") or sub == "expect_tx" or sub == "complete_tx":
            return ("barrier", None, None, None)
        return _OTHER  # init, inval, pending_count
    return _OTHER


def _ptx_operands_matter(mn: str) -> bool:
    return mn.startswith(("cp.async.ca.", "cp.async.cg."))


def _ptx_refine(cls: _Class, line: str) -> _Class:
    m = _PTX_CP_SIZE.match(line, _LINE_RE["ptx"].match(line).end())
    if m:
        return cls[:3] + (int(m.group(1), 0) * 8,)
    return cls


# --------------------------------------------------------------------------
# SASS

_SASS_MEM = {
    # op: (space, kind)
    "LDG": ("global", "load"),
    "STG": ("global", "store"),
    "LDS": ("shared", "load"),
    "STS": ("shared", "store"),
    "LDL": ("local", "load"),
    "STL": ("local", "store"),
    "LD": ("generic", "load"),
    "ST": ("generic", "store"),
    "LDC": ("const", "load"),
    "ULDC": ("const", "load"),
    "ATOMG": ("global", "atomic"),
    "ATOMS": ("shared", "atomic"),
    "ATOM": ("generic", "atomic"),
    "RED": ("generic", "atomic"),
    "REDG": ("global", "atomic"),
    "REDAS": ("shared", "atomic"),
    "LDGSTS": ("global", "async_copy"),
    "LDTM": ("tmem", "load"),
    "STTM": ("tmem", "store"),
    "TEX": ("texture", "load"),
    "TLD": ("texture", "load"),
    "TLD4": ("texture", "load"),
    "SULD": ("surface", "load"),
    "SUST": ("surface", "store"),
    "SUATOM": ("surface", "atomic"),
    "SURED": ("surface", "atomic"),
}
_SASS_NOWIDTH = {
    "UTMALDG": ("tensor", "async_copy"),
    "UTMASTG": ("tensor", "async_copy"),
    "UTMAREDG": ("tensor", "atomic"),
    "UTMAPF": ("tensor", "prefetch"),
    "UBLKCP": ("global", "async_copy"),
    "UBLKRED": ("global", "atomic"),
    "UBLKPF": ("global", "prefetch"),
    "CCTL": None,  # cache control: other
}
_SASS_WIDTH_MODS = {
    "U8": 8, "S8": 8,
    "U16": 16, "S16": 16, "F16": 16, "BF16": 16,
    "32": 32, "U32": 32, "S32": 32, "F32": 32, "F16x2": 32, "BF16x2": 32, "BF16_V2": 32,
    "64": 64, "U64": 64, "S64": 64, "F64": 64,
    "128": 128,
}


@lru_cache(maxsize=4096)
def _sass_class(mn: str) -> _Class:
    tokens = mn.split(".")
    op = tokens[0]
    mods = tokens[1:]
    if op in ("LDSM", "STSM"):
        n = 1
        for t in mods:
            if t in ("1", "2", "4"):
                n = int(t)
        return ("memory", "shared", "load" if op == "LDSM" else "store", 32 * n)
    if op in _SASS_MEM:
        space, kind = _SASS_MEM[op]
        width = None if space in ("texture", "surface", "tmem") else 32
        if width is not None:
            for t in mods:
                if t in _SASS_WIDTH_MODS:
                    width = _SASS_WIDTH_MODS[t]
                    break
        return ("memory", space, kind, width)
    if op in _SASS_NOWIDTH:
        sk = _SASS_NOWIDTH[op]
        return _OTHER if sk is None else ("memory", sk[0], sk[1], None)
    if op.endswith("MMA"):  # HMMA, HGMMA, IMMA, DMMA, UTCHMMA, ...
        return ("matrix", None, None, None)
    if op == "WARPGROUP":
        return ("wait", None, None, None) if "DEPBAR" in mods else _OTHER
    if op == "DEPBAR":
        return ("wait", None, None, None)
    if op == "SYNCS":
        if mods and mods[0] == "PHASECHK":
            return ("wait", None, None, None)
        if mods and mods[0].startswith("ARRIVE"):
            return ("barrier", None, None, None)
        return _OTHER
    if op in ("BAR", "WARPSYNC", "ARRIVES", "UCGABAR_ARV", "UCGABAR_WAIT"):
        return ("barrier", None, None, None)
    return _OTHER


# --------------------------------------------------------------------------
# AMDGCN (GCN/CDNA gfx9 and RDNA gfx11/12 spellings)

_AMD_VMEM = re.compile(r"(global|buffer|flat|scratch)_(load|store|atomic)_(\w+)")
_AMD_VMEM_SPACE = {"global": "global", "buffer": "buffer", "flat": "flat", "scratch": "local"}
_AMD_SMEM = re.compile(r"s_(?:buffer_|scratch_)?(load|store|atomic)_(\w+)")
_AMD_SIZE = {
    "byte": 8, "ubyte": 8, "sbyte": 8,
    "short": 16, "ushort": 16, "sshort": 16,
    "dword": 32, "dwordx2": 64, "dwordx3": 96, "dwordx4": 128, "dwordx8": 256, "dwordx16": 512,
}
_AMD_BITS_TOKEN = re.compile(r"[buif](8|16|32|64|96|128|256|512)")
_AMD_DS_OTHER = ("bpermute", "permute", "swizzle", "append", "consume", "gws", "nop",
                 "ordered")


def _amd_width(tokens: list[str]) -> int | None:
    """Bits named by the type suffix tokens (first one found)."""
    for t in tokens:
        if t in _AMD_SIZE:
            return _AMD_SIZE[t]
        m = _AMD_BITS_TOKEN.fullmatch(t)
        if m:
            return int(m.group(1))
    return None


def _amd_format_width(tokens: list[str]) -> int | None:
    # buffer_load_format_xyzw (32 bits a component) / _format_d16_xy (16 bits)
    comp = 16 if "d16" in tokens else 32
    for t in tokens:
        if t and set(t) <= set("xyzw"):
            return comp * len(t)
    return None


@lru_cache(maxsize=4096)
def _amd_class(mn: str) -> _Class:
    if mn.startswith("v_"):
        if mn.startswith(("v_mfma", "v_smfmac", "v_wmma", "v_swmmac")):
            return ("matrix", None, None, None)
        return _OTHER
    if mn.startswith("s_"):
        if mn.startswith(("s_waitcnt", "s_wait_")):
            return ("wait", None, None, None)
        if mn.startswith("s_barrier"):
            return ("barrier", None, None, None)
        m = _AMD_SMEM.fullmatch(mn)
        if m:
            kind = {"load": "load", "store": "store", "atomic": "atomic"}[m.group(1)]
            return ("memory", "scalar", kind, _amd_width(m.group(2).split("_")))
        return _OTHER
    if mn.startswith("ds_"):
        tokens = mn[3:].split("_")
        if not tokens or tokens[0] in _AMD_DS_OTHER:
            return _OTHER
        op = tokens[0]
        mult = 1
        if op in ("read", "load", "write", "store"):
            kind = "load" if op in ("read", "load") else "store"
            body = tokens[1:]
        elif op.startswith(("read2", "write2")):
            kind = "load" if op.startswith("read") else "store"
            mult = 2
            body = tokens[1:]
        else:
            kind = "atomic"
            body = tokens[1:]
        if body and body[0] == "2addr":
            mult = 2
            body = body[1:]
        if body and body[0] == "addtid":  # ds_read_addtid_b32
            body = body[1:]
        if kind == "atomic" and "pk" in tokens:
            width = 32
        elif kind == "atomic" and op.endswith("2"):  # ds_wrxchg2_b32 ...
            width = _amd_width(body)
            width = None if width is None else width * 2
        else:
            width = _amd_width(body)
            if width is not None:
                width *= mult
        return ("memory", "shared", kind, width)
    m = _AMD_VMEM.fullmatch(mn)
    if m:
        space = _AMD_VMEM_SPACE[m.group(1)]
        kind = m.group(2)
        tokens = m.group(3).split("_")
        if kind == "load" and tokens[0] == "lds":  # global_load_lds_dwordx4: straight to LDS
            return ("memory", space, "async_copy", _amd_width(tokens[1:]))
        if tokens[0] == "format":
            return ("memory", space, kind, _amd_format_width(tokens[1:]))
        if kind == "atomic":
            if "pk" in tokens:
                width = 32
            elif "x2" in tokens:
                width = 64
            else:
                width = _amd_width(tokens[1:]) or 32
            return ("memory", space, "atomic", width)
        return ("memory", space, kind, _amd_width(tokens))
    if mn.startswith("image_"):
        for kind in ("load", "store", "atomic"):
            if mn.startswith("image_" + kind):
                return ("memory", "image", kind, None)
        if mn.startswith("image_sample") or mn.startswith("image_gather"):
            return ("memory", "image", "load", None)
    return _OTHER


# 'buffer_load_dword v1, s[4:7], 0 offen lds' writes straight to LDS.
_AMD_LDS_TAIL = r"[ \t][^\n;]*?\blds\b"
_AMD_LDS_OPERAND = re.compile(_AMD_LDS_TAIL)


def _amd_operands_matter(mn: str) -> bool:
    return mn.startswith(("buffer_load_", "global_load_"))


def _amd_refine(cls: _Class, line: str) -> _Class:
    if cls[2] == "load" and _AMD_LDS_OPERAND.match(line, _LINE_RE["amdgcn"].match(line).end()):
        return (cls[0], cls[1], "async_copy", cls[3])
    return cls


# --------------------------------------------------------------------------

_CLASSIFY = {"ptx": _ptx_class, "sass": _sass_class, "amdgcn": _amd_class}
_OPERANDS_MATTER = {
    "ptx": _ptx_operands_matter,
    "sass": lambda mn: False,
    "amdgcn": _amd_operands_matter,
}
_REFINE = {"ptx": _ptx_refine, "sass": lambda cls, line: cls, "amdgcn": _amd_refine}


def _classify_match(m: re.Match, line: str, isa: str, line_no: int) -> Instr:
    mn = m.group("mn")
    if isa == "sass" and m.group("never"):
        cls = _OTHER
    else:
        cls = _CLASSIFY[isa](mn)
        if _OPERANDS_MATTER[isa](mn):
            cls = _REFINE[isa](cls, line)
    return Instr(line_no, _clean_text(line, isa), mn, *cls)


def classify(line: str, isa: str) -> Instr | None:
    """Classify one line of assembly; None for comments, directives, labels and blanks.

    Only the first line of ``line`` is read; the Instr's line_no is 1.
    """
    _check_isa(isa)
    line = line.split("\n", 1)[0]
    m = _LINE_RE[isa].match(line)
    if m is None:
        return None
    return _classify_match(m, line, isa, 1)


def parse(text: str, isa: str) -> list[Instr]:
    """Every instruction line of ``text``, classified (comments, directives, labels skipped).

    A truncated text (cut mid-line) gives what is there: the cut line is read
    as far as it goes.
    """
    _check_isa(isa)
    rx = _LINE_RE[isa]
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        m = rx.match(line)
        if m is not None:
            out.append(_classify_match(m, line, isa, i))
    return out


# Whole-text scanners for the lines whose operands change the classification:
# the same line prefix as _SCAN_RE, then the operand pattern the refine step
# looks for.  findall() gives (ws, mn, size) for PTX and (ws, mn) for AMDGCN.
_SPECIAL_SCAN = {
    "ptx": re.compile(
        "\n" + _WS + _PTX_PRED + r"(cp\.async\.c[ag](?:\.[A-Za-z0-9_:]+)*)" + _PTX_END + _PTX_CP_SIZE_TAIL,
        re.MULTILINE,
    ),
    "amdgcn": re.compile(
        "\n" + _WS + r"((?:buffer|global)_load_[a-z0-9_]*)" + _AMD_END + _AMD_LDS_TAIL, re.MULTILINE
    ),
}


def _special_counts(text: str, isa: str, raw: Counter) -> list:
    """Classify the operand-dependent lines; take them out of ``raw``."""
    out = []
    if isa == "ptx":
        found = Counter(m.group(2, 3) for m in _SPECIAL_SCAN["ptx"].finditer(text))
        for (mn, size), n in found.items():
            if not _ptx_operands_matter(mn):
                continue
            raw[mn] -= n
            out.append((_ptx_class(mn)[:3] + (int(size, 0) * 8,), mn, n))
    elif isa == "amdgcn":
        found = Counter(m.group(2) for m in _SPECIAL_SCAN["amdgcn"].finditer(text))
        for mn, n in found.items():
            cls = _amd_class(mn)
            if not _amd_operands_matter(mn) or cls[2] != "load":
                continue
            raw[mn] -= n
            out.append((cls[:2] + ("async_copy", cls[3]), mn, n))
    return out


def tally(text: str, isa: str) -> dict[tuple, Counter]:
    """Counts per (category, space, kind, width_bits), each a Counter of mnemonics.

    The fast core of mix(): one regex scan over the whole text, one
    classification per distinct mnemonic.
    """
    _check_isa(isa)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n" + text
    found = _SCAN_RE[isa].finditer(text)  # counted as found: memory grows with distinct mnemonics only
    if isa == "sass":
        raw = Counter(m.group(2, 3) for m in found)
        pairs = [((_OTHER if never else _sass_class(mn)), mn, n) for (never, mn), n in raw.items()]
    else:
        raw = Counter(m.group(2) for m in found)
        matter = _OPERANDS_MATTER[isa]
        pairs = _special_counts(text, isa, raw) if any(matter(mn) for mn in raw) else []
        classify_mn = _CLASSIFY[isa]
        pairs.extend((classify_mn(mn), mn, n) for mn, n in raw.items() if n > 0)
    out: dict[tuple, Counter] = {}
    for cls, mn, n in pairs:
        c = out.get(cls)
        if c is None:
            c = out[cls] = Counter()
        c[mn] += n
    return out


# pandas 3 infers its own string dtype (missing = NaN); pandas 2 keeps objects
# (missing = None).  Say so explicitly, so empty and all-missing columns match.
_STR = "str" if int(pd.__version__.split(".", 1)[0]) >= 3 else object


def _sort_key(key: tuple):
    cat, space, kind, width = key
    return (cat, space or "", kind or "", -1 if width is None else width)


def opcode_of(mnemonic: str, isa: str) -> str:
    """The operation a mnemonic names: SASS and PTX drop the dotted modifiers (``PRMT``,
    ``LDG``, ``mul``); an AMDGCN mnemonic is kept whole (``v_perm_b32``: its suffixes are
    part of the operation)."""
    return mnemonic if isa == "amdgcn" else mnemonic.split(".", 1)[0]


def opcodes(text: str, isa: str) -> pd.DataFrame:
    """Instructions per opcode (``opcode_of``), every line counted, most frequent first.

    Columns: ``opcode``, ``count``, ``category`` (the ``mix`` category of its
    mnemonics; several joined by '+' where they differ, e.g. SASS
    ``WARPGROUP`` is a wait as ``WARPGROUP.DEPBAR`` and other as
    ``WARPGROUP.ARRIVE``).
    """
    counts: Counter = Counter()
    cats: dict[str, set] = {}
    for key, names in tally(text, isa).items():
        for mn, n in names.items():
            op = opcode_of(mn, isa)
            counts[op] += n
            cats.setdefault(op, set()).add(key[0])
    ops = sorted(counts, key=lambda o: (-counts[o], o))
    return pd.DataFrame({"opcode": pd.array(ops, dtype=_STR),
                         "count": np.array([counts[o] for o in ops], dtype=np.int64),
                         "category": pd.array(["+".join(sorted(cats[o])) for o in ops], dtype=_STR)},
                        columns=["opcode", "count", "category"])


def mix(text: str, isa: str, include_other: bool = False) -> pd.DataFrame:
    """The instruction mix of an assembly text as a table.

    One row per distinct (category, space, kind, width_bits), sorted by those
    columns, with ``count``, ``bytes_per_thread`` (count * width_bits / 8 for
    memory rows; NaN where the width is unknown; 0 for other categories) and
    ``mnemonics`` ('name:count' pairs, most frequent first). Rows cover
    memory, matrix, barrier and wait instructions ('other' too when
    ``include_other``).
    """
    groups = tally(text, isa)
    keys = sorted((k for k in groups if include_other or k[0] != "other"), key=_sort_key)
    cats, spaces, kinds, widths, counts, nbytes, names = [], [], [], [], [], [], []
    for k in keys:
        c = groups[k]
        n = sum(c.values())
        cats.append(k[0])
        spaces.append(k[1])
        kinds.append(k[2])
        widths.append(k[3])
        counts.append(n)
        if k[0] != "memory":
            nbytes.append(0.0)
        elif k[3] is None:
            nbytes.append(math.nan)
        else:
            nbytes.append(n * k[3] / 8)
        names.append(", ".join(f"{mn}:{cnt}" for mn, cnt in sorted(c.items(), key=lambda x: (-x[1], x[0]))))
    mask = np.fromiter((w is None for w in widths), dtype=bool, count=len(widths))
    vals = np.fromiter((0 if w is None else w for w in widths), dtype=np.int64, count=len(widths))
    return pd.DataFrame(
        {
            "category": pd.array(cats, dtype=_STR),
            "space": pd.array(spaces, dtype=_STR),
            "kind": pd.array(kinds, dtype=_STR),
            "width_bits": pd.arrays.IntegerArray(vals, mask),
            "count": np.array(counts, dtype=np.int64),
            "bytes_per_thread": np.array(nbytes, dtype=np.float64),
            "mnemonics": pd.array(names, dtype=_STR),
        },
        columns=list(MIX_COLUMNS),
    )
