"""Source-line attribution (workbench.asm.lines, `workbench asm lines`, `diff --by-line`).

Fixtures: tests/fixtures/lines_cache (tests/fixtures/make_lines_fixtures.py: a
kernel with a loop and an inlined helper, cross-compiled for sm90, gfx942 and
gfx950), tests/fixtures/lines_cache_off (the same without line info) and the
hint fixtures of tests/fixtures/cache.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from workbench.asm import lines as L
from workbench.asm.cache import list_entries
from workbench.asm.tools import ToolMissing, find_tool

FIX = Path(__file__).parent / "fixtures"
KERNEL = FIX / "lines_kernel.py"
ROOT = Path(__file__).resolve().parents[1]


def _line_of(path: Path, needle: str) -> int:
    hits = [i for i, s in enumerate(path.read_text().splitlines(), 1) if needle in s]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


STORE_LINE = _line_of(KERNEL, "tl.store(")
LOAD_LINE = _line_of(KERNEL, "x = tl.load(")  # inside the inlined helper
CALL_LINE = _line_of(KERNEL, "_load_scaled(x_ptr")  # the helper's call site, in the loop
HINT_STORE_LINE = _line_of(ROOT / "kernels" / "comm" / "remote.py", "tl.store(dst, x, mask=mask)")


def _has_nvdisasm() -> bool:
    try:
        find_tool("nvdisasm")
        find_tool("cuobjdump")
        return True
    except ToolMissing:
        return False


def _stages(entry) -> list[str]:
    out = [s for s in ("source", "ttir", "ttgir", "llir", "ptx", "amdgcn") if s in entry.stages]
    if "cubin" in entry.stages and _has_nvdisasm():
        out.append("sass")
    return out


ENTRIES = {e.arch: e for e in list_entries(FIX / "lines_cache")}
CASES = [(arch, stage) for arch, e in sorted(ENTRIES.items()) for stage in _stages(e)]
ISA_STAGES = ("ptx", "sass", "amdgcn")


@pytest.fixture(scope="module")
def attributions():
    return {(arch, stage): L.entry_lines(ENTRIES[arch], stage) for arch, stage in CASES}


def test_fixtures_cover_every_vendor():
    assert set(ENTRIES) == {"sm90", "gfx942", "gfx950"}
    assert ("sm90", "sass") in CASES or not _has_nvdisasm()
    size = sum(p.stat().st_size for p in FIX.glob("lines_cache*/**/*") if p.is_file())
    assert size < 1_000_000


def _by_class(df) -> dict:
    out: dict = {}
    for r in df.itertuples(index=False):
        k = tuple(None if pd.isna(v) else v for v in (r.category, r.space, r.kind, r.width_bits))
        out[k] = out.get(k, 0) + int(r.count)
    return out


@pytest.mark.parametrize("arch,stage", CASES)
def test_store_line_gets_every_store(attributions, arch, stage):
    attr = attributions[arch, stage]
    assert attr.line_info and attr.note is None
    table = L.line_table(attr)
    stores = table[(table["kind"] == "store") & table["space"].isin(["global", "buffer", "flat"])]
    assert len(stores) and set(stores["line"]) == {STORE_LINE}, stores
    assert {os.path.basename(f) for f in stores["file"]} == {KERNEL.name}
    entry = ENTRIES[arch]
    if stage in ISA_STAGES:
        # per-line counts sum to the whole-kernel mix, class by class
        mix = entry.mix(stage)
        assert _by_class(table) == _by_class(mix)
        mix_stores = mix[(mix["kind"] == "store") & mix["space"].isin(["global", "buffer", "flat"])]
        assert stores["count"].sum() == mix_stores["count"].sum()
    elif stage != "llir":
        assert stores["count"].sum() == entry.text(stage).count(" tt.store ")


@pytest.mark.parametrize("arch,stage", CASES)
def test_inlined_helper_keeps_its_line_and_call_site(attributions, arch, stage):
    attr = attributions[arch, stage]
    loads = [i for i in attr.instrs if i.kind == "load" and i.space in ("global", "buffer", "flat")]
    assert loads and {i.line for i in loads} == {LOAD_LINE}
    if stage == "source":  # the front-end IR has not inlined yet: the helper is its own function
        assert any(i.mnemonic == "tt.call" and i.line == CALL_LINE for i in attr.instrs)
        return
    assert all(i.via and i.via[0][1] == CALL_LINE and os.path.basename(i.via[0][0]) == KERNEL.name for i in loads)
    # the call site's line lists them too
    assert {i.text_line for i in loads} <= {i.text_line for i in L.line_instructions(attr, CALL_LINE)}


def test_source_view_rows(attributions):
    view = L.source_view(attributions["sm90", "ptx"])
    row = view[view["line"] == STORE_LINE].iloc[0]
    assert "tl.store(" in row["source"] and "global store 128-bit x" in row["instructions"]
    assert view.loc[view["line"] == CALL_LINE, "calls"].iloc[0] > 0
    assert list(view["line"].dropna()) == sorted(view["line"].dropna())


OFF = list_entries(FIX / "lines_cache_off")


@pytest.mark.parametrize("stage", [s for s in ("ttgir", "llir", "ptx", "sass") if OFF and s in _stages(OFF[0])])
def test_entry_without_line_info_says_so(stage):
    attr = L.entry_lines(OFF[0], stage)
    assert not attr.line_info and attr.instrs
    assert "TRITON_DISABLE_LINE_INFO" in attr.note and "recompile" in attr.note
    assert all(i.line is None for i in attr.instrs)
    view = L.source_view(attr)
    assert len(view) == 1 and "no line info" in view["source"].iloc[0]


def _hint_pairs():
    by = {}
    for e in list_entries(FIX / "cache"):
        by[e.arch, bool(e.specialization()["constexprs"]["HINT"])] = e
    out = []
    for arch in ("sm90", "gfx942", "gfx950"):
        for stage in (("ptx", "sass") if arch == "sm90" else ("amdgcn",)):
            if stage == "sass" and not _has_nvdisasm():
                continue
            out.append((arch, stage, by[arch, False], by[arch, True]))
    return out


@pytest.mark.parametrize("arch,stage,a,b", _hint_pairs(), ids=lambda x: x if isinstance(x, str) else "")
def test_by_line_diff_names_the_store_line(arch, stage, a, b):
    d = L.diff_by_line(L.entry_lines(a, stage), L.entry_lines(b, stage))
    stores = d[(d["kind"] == "store") & (d["space"] == "global")]
    assert len(stores) == 1, d
    row = stores.iloc[0]
    assert row["line"] == HINT_STORE_LINE and os.path.basename(row["file"]) == "remote.py"
    assert row["a"].endswith("x 16-bit") and row["b"].endswith("x 128-bit")
    assert row["count_a"] > row["count_b"]
    text = "\n".join(L.describe_changes(d))
    assert f"remote.py:{HINT_STORE_LINE} `tl.store(dst, x, mask=mask)`: global store" in text


# -- the CLI -------------------------------------------------------------------


def _cli(capsys, *argv):
    from workbench.cli import main

    rc = main(["asm", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_lines_json_rows(capsys):
    e = ENTRIES["sm90"]
    rc, out, _ = _cli(capsys, "lines", str(e.path), "--stage", "ttgir,ptx", "--json")
    assert rc == 0
    obj = json.loads(out)
    assert obj["stages"]["ptx"]["line_info"] is True
    need = {"file", "line", "stage", "space", "kind", "width_bits", "count"}
    assert obj["rows"] and all(need <= set(r) for r in obj["rows"])
    st = [r for r in obj["rows"] if r["stage"] == "ptx" and r["kind"] == "store"]
    assert [(r["line"], r["width_bits"]) for r in st] == [(STORE_LINE, 128)]


def test_cli_lines_table_and_line(capsys):
    e = ENTRIES["gfx942"]
    rc, out, _ = _cli(capsys, "lines", str(e.path))
    assert rc == 0
    row = next(s for s in out.splitlines() if "tl.store(" in s)
    assert row.split()[0] == str(STORE_LINE) and "global store" in row
    rc, out, _ = _cli(capsys, "lines", str(e.path), "--line", str(CALL_LINE), "--json")
    obj = json.loads(out)
    assert obj["line"] == CALL_LINE and obj["instructions"]
    assert any(i["line"] == LOAD_LINE and i["text"].startswith("global_load") for i in obj["instructions"])
    rc, out, _ = _cli(capsys, "lines", str(e.path), "--line", str(CALL_LINE))
    assert "(inlined: lines_kernel.py:%d)" % LOAD_LINE in out


def test_cli_lines_without_line_info_warns(capsys):
    rc, out, err = _cli(capsys, "lines", str(OFF[0].path), "--stage", "ptx")
    assert rc == 0 and "TRITON_DISABLE_LINE_INFO" in err and "no line info" in out


def test_cli_diff_by_line(capsys):
    pair = next(p for p in _hint_pairs() if p[0] == "gfx942")
    rc, out, _ = _cli(capsys, "diff", str(pair[2].path), str(pair[3].path), "--by-line")
    assert rc == 0
    assert f"remote.py:{HINT_STORE_LINE} `tl.store(dst, x, mask=mask)`: global store" in out
    rc, out, _ = _cli(capsys, "diff", str(pair[2].path), str(pair[3].path), "--by-line", "--json")
    rows = json.loads(out)["rows"]
    assert {r["line"] for r in rows if r["kind"] == "store" and r["space"] == "global"} == {HINT_STORE_LINE}


# -- parsers on hand-written input ----------------------------------------------


def test_mlir_locations_fused_callsite_name_and_cycles():
    text = "\n".join([
        '#loc = loc("/k/a.py":10:0)',
        '    %0 = tt.load %p : tensor<4x!tt.ptr<f16>> loc(#loc5)',
        '    tt.store %q, %0 : tensor<4x!tt.ptr<f16>> loc(fused[#loc6, "/k/a.py":3:1])',
        '    gpu.barrier loc(#loc8)',
        '    %1 = arith.addi %a, %b : i32 loc("/k/b.py":7:2)',
        '#loc2 = loc("/k/h.py":4:8)',
        '#loc3 = loc("/k/a.py":12:5)',
        '#loc4 = loc("x"(#loc2))',
        '#loc5 = loc(callsite(#loc4 at #loc3))',
        '#loc6 = loc(unknown)',
        '#loc7 = loc(callsite(#loc8 at #loc3))',
        '#loc8 = loc(callsite(#loc7 at #loc3))',
    ])
    a = L.attribute(text, "ttgir")
    load, store, barrier, add = a.instrs
    assert (load.file, load.line, load.via) == ("/k/h.py", 4, (("/k/a.py", 12),))
    assert (store.line, store.kind) == (3, "store")
    assert barrier.category == "barrier"  # a cycle of aliases ends (bounded), whatever it resolves to
    assert (add.file, add.line, add.category) == ("/k/b.py", 7, "other")


def test_llvm_dilocation_inlined_at_and_inline_asm():
    text = "\n".join([
        'define void @k(ptr addrspace(1) %0) !dbg !4 {',
        '  tail call void asm sideeffect "@$2 st.global.v4.b32 [ $1 + 0 ], { $0 };", "r,l,b"(i32 %1, ptr addrspace(1) %0, i1 true), !dbg !8',
        '  store <2 x half> %3, ptr addrspace(3) %4, align 4, !dbg !7',
        '  tail call void @llvm.nvvm.barrier.cta.sync.aligned.all(i32 0), !dbg !7',
        '  ret void',
        '}',
        '!1 = !DIFile(filename: "a.py", directory: "/k")',
        '!4 = distinct !DISubprogram(name: "k", scope: !1, file: !1, line: 3)',
        '!5 = distinct !DILexicalBlockFile(scope: !4, file: !1, discriminator: 0)',
        '!7 = !DILocation(line: 9, column: 2, scope: !4)',
        '!8 = !DILocation(line: 21, column: 4, scope: !5, inlinedAt: !7)',
    ])
    a = L.attribute(text, "llir")
    by_kind = {(i.category, i.space, i.kind, i.width_bits): i for i in a.instrs}
    st = by_kind["memory", "global", "store", 128]
    assert (st.file, st.line, st.via) == ("/k/a.py", 21, (("/k/a.py", 9),))
    assert by_kind["memory", "shared", "store", 32].line == 9
    assert by_kind["barrier", None, None, None].line == 9


def test_ptx_inlined_at_syntax_and_line_zero():
    text = "\n".join([
        '.visible .entry k()',
        '{',
        '\tld.param.b64 %rd1, [k_param_0];',
        '\t.loc\t1 21 24, function_name $L__info_string0, inlined_at 1 37 58',
        '\tld.global.b64 %rd2, [%rd1];',
        '\t.loc\t1 0 0',
        '\tst.global.b16 [%rd1], %rs1;',
        '}',
        '\t.file\t1 "/k/remote.py"',
    ])
    a = L.attribute(text, "ptx")
    param, load, store = a.instrs
    assert param.line is None and store.line is None  # before any .loc; line 0
    assert (load.file, load.line, load.via) == ("/k/remote.py", 21, (("/k/remote.py", 37),))


def test_attribute_rejects_unknown_stage():
    with pytest.raises(ValueError, match="choose one of"):
        L.attribute("", "python")


# -- reading the kernel source a location names -----------------------------------


def test_read_source_refuses_what_is_not_a_small_regular_file(tmp_path):
    good = tmp_path / "k.py"
    good.write_text("a = 1\nb = 2\n")
    assert L.read_source(str(good)) == (["a = 1", "b = 2"], None)
    link = tmp_path / "link.py"
    link.symlink_to(good)
    lines, why = L.read_source(str(link))
    assert lines is None and "not a regular file" in why
    big = tmp_path / "big.py"
    big.write_bytes(b"#" * 2048)
    lines, why = L.read_source(str(big), limit=1024)
    assert lines is None and "MiB" in why
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    lines, why = L.read_source(str(fifo))  # must not block
    assert lines is None and "not a regular file" in why
    lines, why = L.read_source(str(tmp_path / "missing" / "nothere.py"))
    assert lines is None and why


def test_source_view_without_readable_source_keeps_the_counts(tmp_path, attributions):
    attr = attributions["gfx950", "amdgcn"]
    moved = L.Attribution(attr.stage, [L.LineInstr(**{**i.__dict__, "file": "/nowhere/x.py"} if i.line else i.__dict__)
                                       for i in attr.instrs], attr.line_info, None, ["/nowhere/x.py"], attr.text)
    view = L.source_view(moved)
    store = view[view["line"] == STORE_LINE].iloc[0]
    assert store["source"] == "" and "global store" in store["instructions"]


# -- the largest kernel we compile: the warp-specialised Gluon GEMM ------------------


@pytest.fixture(scope="module")
def gemm_ws_entry(tmp_path_factory):
    import ws_checks  # tests/ws_checks.py: compiles in a child process, interpreter off

    cfg = {"cooperative": True, "block_n": 256, "num_stages": 3}
    case = {"module": "gemm", "config": cfg, "dtype": "bfloat16", "dir": str(tmp_path_factory.mktemp("ws")),
            "kwargs": {"shape": [4096, 4096, 4096]}}
    return ws_checks.compile_ws([case], ROOT)[0]


@pytest.mark.parametrize("stage", ["ttgir", "llir", "ptx", "sass"])
def test_gluon_gemm_lines_complete_and_fast(gemm_ws_entry, stage):
    import time

    if stage == "sass" and not _has_nvdisasm():
        pytest.skip("needs nvdisasm and cuobjdump (the Triton wheel ships them)")
    t0 = time.perf_counter()
    attr = L.entry_lines(gemm_ws_entry, stage)
    view = L.source_view(attr)
    elapsed = time.perf_counter() - t0
    assert attr.line_info and len(view) > 50
    table = L.line_table(attr)
    if stage in ISA_STAGES:
        assert _by_class(table) == _by_class(gemm_ws_entry.mix(stage))
    # every wgmma comes from kernels/gemm/gluon.py; in PTX exactly from the warpgroup_mma line of the mainloop
    mma = table[table["category"] == "matrix"]
    assert len(mma) and {os.path.basename(f) for f in mma["file"].dropna()} == {"gluon.py"}
    if stage == "ptx":
        wgmma_line = _line_of(ROOT / "kernels" / "gemm" / "gluon.py", "acc = warpgroup_mma(")
        assert set(mma["line"]) == {wgmma_line}
    # generous bound for a shared CI machine; measured ~0.2-0.5 s per stage on 2 cores
    assert elapsed < 5, elapsed


def test_study01_names_the_store_line():
    from kernels.comm import isa_hints as K

    frames = [K.store_line_changes(a, b, stage, target=arch) for arch, stage, a, b in _hint_pairs()]
    changes = pd.concat(frames, ignore_index=True)
    assert len(changes) == len(frames) and set(changes["line"]) == {HINT_STORE_LINE}
    assert all(before.endswith("16-bit") and after.endswith("128-bit")
               for before, after in zip(changes["stores before"], changes["stores after"]))
    text = K.store_line_sentence(changes)
    assert text.startswith("The stores the hint changed come from one source line: "
                           f"**remote.py:{HINT_STORE_LINE}** `tl.store(dst, x, mask=mask)`")
    assert "gfx942 amdgcn: 8 x 16-bit -> 1 x 128-bit" in text
    assert K.store_line_sentence(changes.iloc[:0]).startswith("_No source line")


@pytest.mark.parametrize("stage", L.LINE_STAGES)
def test_hostile_text_is_bounded_not_fatal(stage):
    chain = "\n".join(f"#loc{i} = loc(callsite(#loc{i + 1} at #loc{i + 1}))" for i in range(3000))
    dbg = "\n".join(f"!{i} = !DILocation(line: 1, column: 1, scope: !{i + 1}, inlinedAt: !{i + 1})"
                    for i in range(3000))
    junk = "\x00\x0c)))(((loc(#loc0) .loc 9 9 9 @[ a:1:1 \n  %x = load i32, ptr %p, !dbg !0\n" * 50
    text = "  tt.store %a, %b loc(#loc0)\n" + chain + "\n" + dbg + "\n" + junk
    a = L.attribute(text, stage, sass_lines=junk, ptx=junk)
    assert isinstance(a.instrs, list)
    L.source_view(a)
    L.line_table(a)


def test_ir_local_alloc_with_a_value_is_a_shared_store():
    a = L.attribute('    %0 = ttg.local_alloc %x : (tensor<4xf16>) -> !ttg.memdesc<4xf16> loc("/a.py":3:1)\n'
                    '    %1 = ttg.local_alloc : () -> !ttg.memdesc<4xf16> loc("/a.py":4:1)\n', "ttgir")
    assert [(i.line, i.space, i.kind) for i in a.instrs] == [(3, "shared", "store"), (4, None, None)]
