"""Compare two compiled entries: stage text, instruction mix and metadata."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import pandas as pd

from .cache import CacheError, Entry, normalize_stage
from .isa import opcodes

# Mix columns that are measures; every other column identifies an instruction class.
_MEASURES = ("count", "bytes_per_thread")
MAX_DIFF_LINES = 200_000  # per side; the largest real stage (a Gluon GEMM's llir, 1.9 MB) has about 30,000
_IGNORED_META = {"hash", "extern_libs", "name"}


@dataclass
class Row:
    """One line of a side-by-side diff: tag is equal, replace, delete or insert."""

    tag: str
    a_no: int | None
    a: str
    b_no: int | None
    b: str


@dataclass
class EntryDiff:
    stage: str
    rows: list[Row]
    mix: pd.DataFrame
    metadata: dict[str, tuple] = field(default_factory=dict)
    opcodes: pd.DataFrame = field(default_factory=lambda: _opcode_frame([]))  # opcode_delta of the stage

    @property
    def changed_lines(self) -> int:
        return sum(r.tag != "equal" for r in self.rows)


def side_by_side(a: str, b: str) -> list[Row]:
    """Align two texts line by line with difflib."""
    la, lb = a.splitlines(), b.splitlines()
    rows: list[Row] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, la, lb, autojunk=False).get_opcodes():
        n = max(i2 - i1, j2 - j1)
        for k in range(n):
            ia, ib = i1 + k, j1 + k
            rows.append(Row(
                tag,
                ia + 1 if ia < i2 else None, la[ia] if ia < i2 else "",
                ib + 1 if ib < j2 else None, lb[ib] if ib < j2 else "",
            ))
    return rows


def mix_delta(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Counts per instruction class in a and b, and b - a; only classes that occur."""
    keys = [c for c in ("category", "space", "kind", "width_bits") if c in a.columns]
    left = a[keys + ["count"]].rename(columns={"count": "count_a"})
    right = b[keys + ["count"]].rename(columns={"count": "count_b"})
    # NaN keys (e.g. the space of a barrier) must still match each other in the merge.
    left, right = (df.astype({k: object for k in keys}).fillna({k: "" for k in keys}) for df in (left, right))
    merged = pd.merge(left, right, on=keys, how="outer")
    merged[["count_a", "count_b"]] = merged[["count_a", "count_b"]].fillna(0).astype(int)
    merged["delta"] = merged["count_b"] - merged["count_a"]
    if "mnemonics" in a.columns and "mnemonics" in b.columns:
        merged["mnemonics"] = [_names(a, b, row) for row in merged[keys].itertuples(index=False)]
    order = lambda s: pd.to_numeric(s, errors="coerce").fillna(-1) if s.name == "width_bits" else s.astype(str)
    return merged.sort_values(keys, key=order).reset_index(drop=True)


def opcode_delta(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Counts per opcode (``isa.opcodes`` tables) in a and b, and b - a; every opcode of either,
    the largest changes first."""
    merged = pd.merge(a[["opcode", "count"]].rename(columns={"count": "count_a"}),
                      b[["opcode", "count"]].rename(columns={"count": "count_b"}), on="opcode", how="outer")
    merged[["count_a", "count_b"]] = merged[["count_a", "count_b"]].fillna(0).astype(int)
    merged["delta"] = merged["count_b"] - merged["count_a"]
    order = merged["delta"].abs().sort_values(ascending=False, kind="stable").index
    return merged.loc[order].reset_index(drop=True)


def _opcode_frame(rows: list) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["opcode", "count_a", "count_b", "delta"])


def _names(a: pd.DataFrame, b: pd.DataFrame, key: tuple) -> str:
    """Mnemonic names (without counts) of one instruction class, from both sides."""
    names: list[str] = []
    for df in (a, b):
        for _, row in df.iterrows():
            if tuple("" if pd.isna(row[k]) else row[k] for k in ("category", "space", "kind", "width_bits")) == key:
                for part in str(row["mnemonics"]).split(","):
                    name = part.rsplit(":", 1)[0].strip()
                    if name and name not in names:
                        names.append(name)
    return ", ".join(names)


def metadata_delta(a: Entry, b: Entry) -> dict[str, tuple]:
    """Metadata keys whose values differ: {key: (a, b)}."""
    keys = sorted((set(a.metadata) | set(b.metadata)) - _IGNORED_META)
    return {k: (a.metadata.get(k), b.metadata.get(k)) for k in keys if a.metadata.get(k) != b.metadata.get(k)}


def diff_entries(a: Entry, b: Entry, stage: str | None = None) -> EntryDiff:
    """Side-by-side text, mix delta and metadata delta of one stage of two entries."""
    stage = normalize_stage(stage or a.final_stage)
    text_a, text_b = a.text(stage), b.text(stage)  # read once: SASS costs a cuobjdump run
    for e, text in ((a, text_a), (b, text_b)):
        n = text.count("\n")
        if n > MAX_DIFF_LINES:  # difflib holds every line, and its time grows faster than the size
            raise CacheError(f"{e.path}: the {stage} has {n:,} lines; side-by-side diffs stop at "
                             f"{MAX_DIFF_LINES:,}: compare `workbench asm mix` of both entries, or diff the "
                             "`workbench asm show` outputs with a diff tool")
    if stage in ("ptx", "amdgcn", "sass"):
        mix = mix_delta(a.mix(stage, text_a), b.mix(stage, text_b))
        ops = opcode_delta(opcodes(text_a, stage), opcodes(text_b, stage))
    else:
        mix = pd.DataFrame(columns=["category", "space", "kind", "width_bits", "count_a", "count_b", "delta"])
        ops = _opcode_frame([])
    return EntryDiff(stage, side_by_side(text_a, text_b), mix, metadata_delta(a, b), ops)


def unified(a_text: str, b_text: str, a_name: str = "a", b_name: str = "b", context: int = 3) -> str:
    return "".join(difflib.unified_diff(a_text.splitlines(True), b_text.splitlines(True), a_name, b_name, n=context))
