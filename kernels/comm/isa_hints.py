"""Kernels of study 01 (`notebooks/01_isa_hints.ipynb`): store widths and hints.

Two patterns from the seeds, in the form a reader can cross-compile anywhere:

- `kernels.comm.remote.remote_store_kernel`: a store through a pointer rebuilt from a loaded heap
  base (iris' `translate`: local heap offset + peer base, through uint64).
  The integer round trip erases what the compiler knew about alignment and
  contiguity, so without `HINT` every thread stores scalars (16-bit for fp16);
  with `tl.multiple_of`/`tl.max_contiguous` re-stated it stores 128-bit vectors.
- `_gluon_remote_store_kernel`: the same store in Gluon with an explicit
  `BlockedLayout`; `SPT` (size per thread) elements of contiguous data per
  thread bound the vector width (fp16: 1 -> 16 bit, 2 -> 32, 4 -> 64, 8 -> 128).

Launchers (`remote_store`, `gluon_remote_store`) run on a CUDA/ROCm GPU with the
"peer" heap being a second local buffer; `reference` is the torch copy they
must equal. `compile_*` cross-compile for named targets with no GPU,
`store_table` turns entries into one row per global-store instruction class, and
`store_line_changes` names the source line whose stores a hint changed.
"""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels.comm.remote import remote_store_kernel
from workbench.asm.compile import warp_size  # the target table's, so a new target needs one entry

# dtype name (the study's parameter) -> Triton pointer type and bytes per element
DTYPES = {
    "fp16": ("*fp16", 2),
    "bf16": ("*bf16", 2),
    "fp32": ("*fp32", 4),
    "i8": ("*i8", 1),
}


@gluon.jit
def _gluon_remote_store_kernel(heap_bases_ptr, x_ptr, n, RANK: gl.constexpr, PEER: gl.constexpr,
                               BLOCK: gl.constexpr, SPT: gl.constexpr, TPW: gl.constexpr,
                               WARPS: gl.constexpr, HINT: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[SPT], threads_per_warp=[TPW],
                                            warps_per_cta=[WARPS], order=[0])
    pid = gl.program_id(0)
    offs = pid * BLOCK + gl.arange(0, BLOCK, layout=layout)
    mask = offs < n
    x = gl.load(x_ptr + offs, mask=mask)
    local_base = gl.load(heap_bases_ptr + RANK)  # hoisted once per program, as in seed 001
    remote_base = gl.load(heap_bases_ptr + PEER)
    offset = (x_ptr + offs).to(gl.uint64, bitcast=True) - local_base.to(gl.uint64)
    remote_ptr = (remote_base.to(gl.uint64) + offset).to(x_ptr.dtype, bitcast=True)
    if HINT:
        remote_ptr = gl.max_contiguous(gl.multiple_of(remote_ptr, BLOCK), BLOCK)
    gl.store(remote_ptr, x, mask=mask)


# ---------------------------------------------------------------------------
# cross-compilation (no GPU needed)


def _signature(dtype: str, heap: str = "heap_bases_ptr") -> dict:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return {heap: "*i64", "x_ptr": DTYPES[dtype][0], "n": "i32"}


def gluon_block(block: int, spt: int, target: str, num_warps: int) -> int:
    """The block a Gluon variant uses: `block`, grown to one full layout tile if smaller."""
    return max(block, spt * warp_size(target) * num_warps)


def compile_remote_store(targets, *, block: int, dtype: str, hint: bool, cache_dir,
                         num_warps: int = 4):
    """Cross-compile `kernels.comm.remote.remote_store_kernel` for each target; one Entry per target."""
    from workbench.asm.compile import cross_compile

    return cross_compile(remote_store_kernel, list(targets), signature=_signature(dtype, "heap_bases"),
                         constexprs={"rank": 0, "peer": 1, "BLOCK": block, "HINT": bool(hint)},
                         divisible=[0, 1, 2], num_warps=num_warps, cache_dir=cache_dir)


def compile_gluon_store(target: str, *, spt: int, block: int, dtype: str, cache_dir,
                        num_warps: int = 4, hint: bool = True):
    """Cross-compile `_gluon_remote_store_kernel` with size_per_thread=`spt` for one target."""
    from workbench.asm.compile import cross_compile

    blk = gluon_block(block, spt, target, num_warps)
    (entry,) = cross_compile(
        _gluon_remote_store_kernel, [target], signature=_signature(dtype),
        constexprs={"RANK": 0, "PEER": 1, "BLOCK": blk, "SPT": spt, "TPW": warp_size(target),
                    "WARPS": num_warps, "HINT": bool(hint)},
        divisible=[0, 1, 2], num_warps=num_warps, cache_dir=cache_dir)
    return entry


def isas_of(entry) -> list[str]:
    """The assembly texts worth reading for an entry: PTX and SASS on NVIDIA, AMDGCN on AMD."""
    if entry.backend == "hip":
        return ["amdgcn"]
    return ["ptx", "sass"] if "cubin" in entry.stages else ["ptx"]


def global_stores(entry, isa: str):
    """The global-store instructions (workbench.asm.isa.Instr) of one stage of an entry."""
    from workbench.asm.isa import parse

    return [i for i in parse(entry.text(isa), isa)
            if i.category == "memory" and i.space in ("global", "flat", "buffer") and i.kind == "store"]


def store_table(entry, isa: str, **labels) -> pd.DataFrame:
    """One row per global-store mnemonic: count, width, bytes per thread, an example line."""
    rows = {}
    for ins in global_stores(entry, isa):
        r = rows.setdefault(ins.mnemonic, {"mnemonic": ins.mnemonic, "width_bits": ins.width_bits,
                                          "count": 0, "example": ins.text})
        r["count"] += 1
    out = pd.DataFrame(list(rows.values()),
                       columns=["mnemonic", "width_bits", "count", "example"])
    out["bytes_per_thread"] = out["count"] * out["width_bits"].astype("float") / 8
    for k, v in reversed(list(labels.items())):
        out.insert(0, k, v)
    out.insert(len(labels), "isa", isa)
    out.insert(len(labels) + 1, "hash", entry.hash[:10])
    return out


_GLOBAL_SPACES = ("global", "flat", "buffer")


def store_line_changes(a, b, isa: str, **labels) -> pd.DataFrame:
    """The source lines whose global stores changed from entry `a` to `b` in one ISA.

    One row per changed line (workbench.asm.lines.diff_by_line): file, line, the
    Python statement, and the stores before and after (e.g. '16 x 16-bit' ->
    '2 x 128-bit'); `labels` become leading columns.
    """
    from workbench.asm.lines import diff_by_line, entry_lines

    d = diff_by_line(entry_lines(a, isa), entry_lines(b, isa))
    d = d[(d["category"] == "memory") & (d["kind"] == "store") & d["space"].isin(_GLOBAL_SPACES)]
    out = d[["file", "line", "source", "a", "b"]].rename(columns={"a": "stores before", "b": "stores after"})
    out = out.reset_index(drop=True)
    out.insert(0, "isa", isa)
    for k, v in reversed(list(labels.items())):
        out.insert(0, k, v)
    return out


def store_line_sentence(changes: pd.DataFrame) -> str:
    """Markdown naming the line(s) whose stores changed, with the before/after per target and ISA."""
    if changes.empty:
        return "_No source line's global stores changed._"
    where = [f"{Path(f).name}:{ln}" for f, ln in zip(changes["file"], changes["line"])]
    first = dict(zip(where, changes["source"]))  # each line once, in order
    names = ", ".join(f"**{w}** `{src}`" if src else f"**{w}**" for w, src in first.items())
    each = "; ".join(f"{t} {isa}: {before} -> {after}" for t, isa, before, after in
                     zip(changes["target"], changes["isa"], changes["stores before"], changes["stores after"]))
    one = "one source line" if len(first) == 1 else f"{len(first)} source lines"
    return f"The stores the hint changed come from {one}: {names} ({each})."


# ---------------------------------------------------------------------------
# launchers (GPU) and the reference


def _check(x, out):
    import torch

    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        raise ValueError("x and out must be torch tensors")
    if x.device.type != "cuda" or out.device != x.device:
        raise ValueError(f"x and out must be on one GPU (got {x.device} and {out.device})")
    if x.shape != out.shape or x.dtype != out.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and out {tuple(out.shape)} {out.dtype} must match")
    if not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("x and out must be contiguous")
    if x.numel() >= 2**31:
        raise ValueError(f"x has {x.numel()} elements; the kernels index with int32 (< 2**31)")


def _heap_bases(x, out):
    import torch

    # rank 0's heap holds x; the "peer" (rank 1) heap is out: a remote store lands in out
    return torch.tensor([x.data_ptr(), out.data_ptr()], dtype=torch.int64, device=x.device)


def remote_store(x, out, *, hint: bool = True, block: int = 2048, num_warps: int = 4, heap_bases=None):
    """out[:] = x through the translated ("remote") pointer; returns out."""
    _check(x, out)
    bases = _heap_bases(x, out) if heap_bases is None else heap_bases
    n = x.numel()
    remote_store_kernel[(triton.cdiv(n, block),)](bases, x, n, rank=0, peer=1, BLOCK=block,
                                                    HINT=bool(hint), num_warps=num_warps)
    return out


def gluon_remote_store(x, out, *, spt: int = 8, block: int = 2048, num_warps: int = 4,
                       hint: bool = True, heap_bases=None):
    """out[:] = x with the Gluon kernel, `spt` elements per thread; returns out."""
    _check(x, out)
    warp = triton.runtime.driver.active.get_current_target().warp_size
    blk = max(block, spt * warp * num_warps)
    bases = _heap_bases(x, out) if heap_bases is None else heap_bases
    n = x.numel()
    _gluon_remote_store_kernel[(triton.cdiv(n, blk),)](bases, x, n, RANK=0, PEER=1, BLOCK=blk, SPT=spt,
                                                       TPW=warp, WARPS=num_warps, HINT=bool(hint),
                                                       num_warps=num_warps)
    return out


def reference(x, out):
    """What both launchers must produce."""
    return out.copy_(x)


def default_cache_dir() -> Path:
    """Where the study compiles to: $WORKBENCH_ISA_CACHE, else a fixed folder under the temp dir."""
    import tempfile

    env = os.environ.get("WORKBENCH_ISA_CACHE")
    return Path(env) if env else Path(tempfile.gettempdir()) / "workbench-isa-hints-cache"


# ---------------------------------------------------------------------------
# the study's tables and conclusions (computed from the compiled entries)


def summarize(stores: pd.DataFrame) -> pd.DataFrame:
    """One row per (study, target, isa, dtype, block, variant) from `store_table` rows."""
    keys = ["study", "target", "isa", "dtype", "block", "variant"]
    out = (stores.groupby(keys, sort=False)
           .agg(store_width_bits=("width_bits", "min"), widest_bits=("width_bits", "max"),
                store_instructions=("count", "sum"), bytes_per_thread=("bytes_per_thread", "sum"),
                mnemonics=("mnemonic", ", ".join), shared=("shared", "first"))
           .reset_index())
    out["series"] = out["target"] + " " + out["isa"]
    return out


def _times(a: int, b: int) -> str:
    if a == b:
        return "as many"
    return f"{a / b:g}x fewer" if a > b else f"{b / a:g}x more"


def conclusions(summary: pd.DataFrame) -> str:
    """Markdown that states what `summarize(...)` shows; every number comes from the table."""
    out: list[str] = []
    h = summary[summary.study == "hint"]
    if len(h):
        pairs = []
        for (target, isa, dtype, block), g in h.groupby(["target", "isa", "dtype", "block"], sort=False):
            if set(g.variant) >= {"no hint", "hint"}:
                pairs.append((target, isa, dtype, block, g[g.variant == "no hint"].iloc[0], g[g.variant == "hint"].iloc[0]))
        widened = sum(after.store_width_bits > before.store_width_bits for *_, before, after in pairs)
        head = f"The hint widened the global stores on **{widened} of {len(pairs)}** target/assembly pairs."
        staged = [(t, b.shared) for t, _, _, _, b, a in pairs if (b.shared or 0) > 0 and not (a.shared or 0)]
        if staged:
            tg = sorted({t for t, _ in staged})
            head += (f" Without it the compiler also staged the data through shared memory "
                     f"({int(max(s for _, s in staged))} bytes on {', '.join(tg)}; none with the hint): "
                     "the load keeps its vector layout and a layout conversion feeds the scalar stores.")
        out += [head, ""]
        for target, isa, dtype, block, before, after in pairs:
            verdict = ("widened" if after.store_width_bits > before.store_width_bits else
                       "did not change" if after.store_width_bits == before.store_width_bits else "narrowed")
            out.append(
                f"- **{target} {isa}** ({dtype}, BLOCK={block}): the hint {verdict} the stores: "
                f"{before.store_instructions} x `{before.mnemonics}` ({before.store_width_bits}-bit) -> "
                f"{after.store_instructions} x `{after.mnemonics}` ({after.store_width_bits}-bit), "
                f"{_times(before.store_instructions, after.store_instructions)} store instructions per thread.")
    g = summary[summary.study == "gluon"].copy()
    if len(g):
        g["spt"] = g.variant.str.removeprefix("SPT=").astype(int)
        out += ["", "Gluon `BlockedLayout` size per thread (SPT):", ""]
        for dtype, gd in g.groupby("dtype", sort=False):
            elem_bits = DTYPES[dtype][1] * 8
            per_spt = gd.groupby("spt").store_width_bits.agg(lambda s: sorted(set(int(v) for v in s)))
            desc = ", ".join(f"SPT={spt} -> {'/'.join(map(str, w))}-bit" for spt, w in per_spt.items())
            same = all(len(w) == 1 for w in per_spt)
            follows = all(w == [min(spt * elem_bits, 128)] for spt, w in per_spt.items())
            full = [spt for spt, w in per_spt.items() if max(w) >= 128]
            line = f"- **{dtype}** ({elem_bits}-bit elements): {desc}"
            line += " on every target" if same else " (the targets differ: see the table)"
            if follows:
                line += f"; the store width is SPT x {elem_bits} bits, up to 128"
            if full:
                line += (f"; 128-bit stores (dwordx4, v4.b32, STG.E.128) need SPT >= {min(full)}, i.e. "
                         f"{min(full) * elem_bits // 8} contiguous bytes per thread.")
            else:
                line += "; no SPT in the sweep reached 128-bit stores."
            out.append(line)
    return "\n".join(out) if out else "_No variants were compiled: nothing to conclude._"
