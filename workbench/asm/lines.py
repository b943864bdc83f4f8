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

import os
import stat
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import pandas as pd

from . import isa as _isa
from .locations import (LineInstr, directive_instrs, llvm_instrs, mlir_instrs, ptx_callsites, sass_instrs,
                        sass_line_map)

__all__ = [
    "LINE_STAGES",
    "via_text",
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

@dataclass
class Attribution:
    stage: str
    instrs: list[LineInstr]
    line_info: bool
    note: str | None = None  # why there is no line info, and what to do
    files: list[str] = field(default_factory=list)
    text: str = field(default="", repr=False)  # the stage text the instructions' text_line index

    @cached_property
    def text_lines(self) -> list[str]:
        return self.text.splitlines()


# ---------------------------------------------------------------------------
# reading kernel sources (untrusted paths recorded in the IR)


def read_source(path: str, limit: int = SOURCE_LIMIT) -> tuple[list[str] | None, str | None]:
    """(lines, None) of a kernel source file named by a recorded location, or (None, why not).

    The one place where this module opens a file a location names: regular files
    only (no symlinks, devices or FIFOs), at most `limit` bytes; errors come back
    as a message, never raised. A path from another checkout is looked up by its
    tail under the working and repository directories.
    """
    from .cache import find_source_file

    try:
        p = find_source_file(path)
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
        instrs = mlir_instrs(text, stage)
    elif stage == "llir":
        instrs = llvm_instrs(text, stage)
    elif stage == "sass":
        instrs = sass_instrs(text, sass_line_map(sass_lines or ""), ptx_callsites(ptx) if ptx else {})
    else:
        instrs = directive_instrs(text, stage)
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
    lines = attr.text_lines
    raw = lines[i.text_line - 1] if 0 < i.text_line <= len(lines) else ""
    if attr.stage in _isa.ISAS:
        ins = _isa.classify(raw, attr.stage)
        if ins is not None:
            return ins.text
    return raw.strip()


def via_text(via: tuple) -> str:
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
        key = (i.file if i.line is not None else None, i.line, via_text(i.via), i.category, i.space, i.kind, i.width_bits)
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
