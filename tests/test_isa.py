"""Instruction classification (workbench.asm.isa) on cross-compiled fixtures and hand lines.

The fixtures under tests/fixtures/isa are written by make_isa_fixtures.py
(Triton 3.6 cross-compiles, no GPU). The ground truth is the iris
`translate` pattern: a store through a pointer rebuilt from a loaded heap
base, with and without a contiguity hint.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from workbench.asm import isa
from workbench.asm.isa import classify, isa_of_stage, mix, parse, tally

FIX = Path(__file__).parent / "fixtures" / "isa"
REPO = Path(__file__).resolve().parents[1]


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def rows(df: pd.DataFrame, **where) -> pd.DataFrame:
    sel = pd.Series(True, index=df.index)
    for col, val in where.items():
        sel &= df[col] == val
    return df[sel]


def global_stores(text: str, which: str) -> dict[int, int]:
    df = rows(mix(text, which), category="memory", space="global", kind="store")
    return {int(w): int(c) for w, c in zip(df.width_bits, df["count"])}


# --------------------------------------------------------------------------
# Ground truth: the remote store with and without the hint.

# file -> ({width_bits: count} of global stores, global bytes stored per thread)
REMOTE_STORE = {
    "remote_store_nohint_sm90.ptx": ({16: 16}, 32),
    "remote_store_hint_sm90.ptx": ({128: 2}, 32),
    "remote_store_nohint_sm90.sass": ({16: 16}, 32),
    "remote_store_hint_sm90.sass": ({128: 2}, 32),
    "remote_store_nohint_gfx942.amdgcn": ({16: 8}, 16),
    "remote_store_hint_gfx942.amdgcn": ({128: 1}, 16),
    "remote_store_nohint_gfx1100.amdgcn": ({16: 16}, 32),
    "remote_store_hint_gfx1100.amdgcn": ({128: 2}, 32),
}


@pytest.mark.parametrize("name", sorted(REMOTE_STORE))
def test_remote_store_global_stores(name):
    text = fixture(name)
    which = name.rsplit(".", 1)[1]
    widths, nbytes = REMOTE_STORE[name]
    assert global_stores(text, which) == widths
    df = rows(mix(text, which), category="memory", space="global", kind="store")
    assert df.bytes_per_thread.sum() == nbytes


@pytest.mark.parametrize(
    "target,which", [("sm90", "ptx"), ("sm90", "sass"), ("gfx942", "amdgcn"), ("gfx1100", "amdgcn")]
)
def test_hint_keeps_bytes_and_cuts_instructions(target, which):
    def store_rows(tag):
        df = mix(fixture(f"remote_store_{tag}_{target}.{which}"), which)
        return rows(df, category="memory", space="global", kind="store")

    plain, hinted = store_rows("nohint"), store_rows("hint")
    assert plain.bytes_per_thread.sum() == hinted.bytes_per_thread.sum()
    assert hinted["count"].sum() * 8 == plain["count"].sum()
    assert set(hinted.width_bits) == {128}
    assert set(plain.width_bits) == {16}


def test_exact_store_mnemonics():
    def names(name, which):
        return Counter(
            i.mnemonic
            for i in parse(fixture(name), which)
            if (i.category, i.space, i.kind) == ("memory", "global", "store")
        )

    assert names("remote_store_nohint_sm90.ptx", "ptx") == {"st.global.b16": 16}
    assert names("remote_store_hint_sm90.ptx", "ptx") == {"st.global.v4.b32": 2}
    assert names("remote_store_nohint_sm90.sass", "sass") == {"STG.E.U16": 16}
    assert names("remote_store_hint_sm90.sass", "sass") == {"STG.E.128": 2}
    assert names("remote_store_nohint_gfx942.amdgcn", "amdgcn") == {
        "global_store_short": 4,
        "global_store_short_d16_hi": 4,
    }
    assert names("remote_store_hint_gfx942.amdgcn", "amdgcn") == {"global_store_dwordx4": 1}
    assert names("remote_store_nohint_gfx1100.amdgcn", "amdgcn") == {
        "global_store_b16": 8,
        "global_store_d16_hi_b16": 8,
    }
    assert names("remote_store_hint_gfx1100.amdgcn", "amdgcn") == {"global_store_b128": 2}


def test_remote_store_loads_sm90():
    # x: two 128-bit loads a thread; the two heap bases: two 64-bit loads.
    for name, which in (("remote_store_hint_sm90.ptx", "ptx"), ("remote_store_nohint_sm90.sass", "sass")):
        df = rows(mix(fixture(name), which), category="memory", space="global", kind="load")
        assert {int(w): int(c) for w, c in zip(df.width_bits, df["count"])} == {64: 2, 128: 2}


def test_nohint_goes_through_shared_memory():
    # Without the hint the layout conversion goes through shared memory.
    df = mix(fixture("remote_store_nohint_sm90.ptx"), "ptx")
    assert int(rows(df, space="shared", kind="store")["count"].sum()) == 2
    assert int(rows(df, space="shared", kind="load")["count"].sum()) == 2
    assert int(rows(df, category="barrier")["count"].sum()) == 1
    assert rows(mix(fixture("remote_store_hint_sm90.ptx"), "ptx"), space="shared").empty
    df = mix(fixture("remote_store_nohint_gfx942.amdgcn"), "amdgcn")
    assert rows(df, space="shared", kind="store")[["width_bits", "count"]].values.tolist() == [[16, 8]]
    assert rows(df, space="shared", kind="load")[["width_bits", "count"]].values.tolist() == [[64, 2]]


# --------------------------------------------------------------------------
# The GEMM fixtures: tensor cores, async copies, waits and barriers.


def test_gemm_sm90_ptx():
    df = mix(fixture("gemm_bf16_sm90.ptx"), "ptx")
    matrix = rows(df, category="matrix")
    assert int(matrix["count"].sum()) == 4
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16:4" in matrix.mnemonics.iloc[0]
    cp = rows(df, category="memory", kind="async_copy")
    assert cp[["space", "width_bits", "count"]].values.tolist() == [["global", 128, 16]]
    assert int(rows(df, category="wait")["count"].sum()) == 4  # 2 cp.async + 2 wgmma waits
    assert int(rows(df, category="barrier")["count"].sum()) == 4
    assert global_stores(fixture("gemm_bf16_sm90.ptx"), "ptx") == {128: 8}
    ldm = rows(df, space="shared", kind="load")
    assert ldm[["width_bits", "count"]].values.tolist() == [[128, 8]]


def test_gemm_sm90_sass():
    text = fixture("gemm_bf16_sm90.sass")
    df = mix(text, "sass")
    matrix = rows(df, category="matrix")
    assert matrix["count"].tolist() == [4]
    assert matrix.mnemonics.tolist() == ["HGMMA.64x128x16.F32.BF16:4"]
    assert rows(df, kind="async_copy")[["space", "width_bits", "count"]].values.tolist() == [
        ["global", 128, 16]
    ]
    assert rows(df, category="wait").mnemonics.tolist() == ["DEPBAR.LE:2, WARPGROUP.DEPBAR.LE:2"]
    assert rows(df, category="barrier")["count"].tolist() == [4]
    assert global_stores(text, "sass") == {128: 8}
    # '@!PT LDS RZ, [RZ]' never runs: not a shared load.
    never = [i for i in parse(text, "sass") if i.text.startswith("@!PT")]
    assert len(never) == 6 and all(i.category == "other" for i in never)
    assert rows(df, space="shared", kind="load").mnemonics.tolist() == ["LDSM.16.M88.4:8"]


def test_gemm_gfx942():
    df = mix(fixture("gemm_bf16_gfx942.amdgcn"), "amdgcn")
    assert rows(df, category="matrix").mnemonics.tolist() == ["v_mfma_f32_32x32x8_bf16:48"]
    assert rows(df, category="wait")["count"].tolist() == [31]
    assert rows(df, category="barrier")["count"].tolist() == [5]
    assert rows(df, space="global", kind="load")[["width_bits", "count"]].values.tolist() == [[128, 12]]
    assert rows(df, space="global", kind="store")[["width_bits", "count"]].values.tolist() == [[64, 8]]
    lds = rows(df, space="shared")
    assert lds[["kind", "width_bits", "count"]].values.tolist() == [
        ["load", 64, 24],
        ["load", 128, 24],
        ["store", 32, 24],
        ["store", 128, 6],
    ]


# --------------------------------------------------------------------------
# Hand-written lines: the tricky cases.

PTX_LINES = [
    ("@%p1 st.global.v4.b32 [ %rd7 + 0 ], { %r1, %r2, %r3, %r4 };", "memory", "global", "store", 128),
    ("@!%p3 st.global.b16 [ %rd7 + 0 ], { %rs1 };", "memory", "global", "store", 16),
    ("\t@%p2 ld.global.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd2 + 0 ];", "memory", "global", "load", 128),
    ("ld.global.nc.v2.b32 { %r1, %r2 }, [ %rd1 + 0 ];", "memory", "global", "load", 64),
    ("ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {%r1,%r2,%r3,%r4}, [%rd1];", "memory", "global", "load", 128),
    ("ld.global.b64 { %rd3 }, [ %rd4 + 0 ];", "memory", "global", "load", 64),
    ("st.global.v8.b32 [%rd1], {%r1,%r2,%r3,%r4,%r5,%r6,%r7,%r8};", "memory", "global", "store", 256),
    ("cp.async.cg.shared.global [ %r17 + 0 ], [ %rd17 + 0 ], 0x10, %r18;", "memory", "global", "async_copy", 128),
    ("cp.async.ca.shared.global [ %r17 + 0 ], [ %rd17 + 0 ], 4;", "memory", "global", "async_copy", 32),
    ("cp.async.ca.shared.global [ %r17 + 0 ], [ %rd17 + 0 ], 8, %r18;", "memory", "global", "async_copy", 64),
    ("cp.async.commit_group;", "other", None, None, None),
    ("cp.async.wait_group 2;", "wait", None, None, None),
    ("cp.async.wait_all;", "wait", None, None, None),
    ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];",
     "memory", "tensor", "async_copy", None),
    ("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd1, {%r2, %r3}], [%r4];",
     "memory", "tensor", "async_copy", None),
    ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1], %r2, [%r3];",
     "memory", "global", "async_copy", None),
    ("cp.async.bulk.wait_group.read 0;", "wait", None, None, None),
    ("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%rd1, {%r1, %r2}], [%r3];",
     "memory", "tensor", "atomic", None),
    ("atom.global.add.f32 %f1, [%rd1], %f2;", "memory", "global", "atomic", 32),
    ("atom.global.acq_rel.sys.cas.b64 %rd1, [%rd2], %rd3, %rd4;", "memory", "global", "atomic", 64),
    ("@%p1 atom.global.sys.release.exch.b32 %r1, [ %rd1 + 0 ], %r2;", "memory", "global", "atomic", 32),
    ("atom.add.u32 %r1, [%rd1], 1;", "memory", "generic", "atomic", 32),
    ("red.global.add.f32 [%rd1], %f1;", "memory", "global", "atomic", 32),
    ("red.release.gpu.global.add.s32 [%rd1], 1;", "memory", "global", "atomic", 32),
    ("red.global.add.noftz.bf16x2 [%rd1], %r1;", "memory", "global", "atomic", 32),
    ("atom.shared.add.u32 %r1, [%r2], 1;", "memory", "shared", "atomic", 32),
    ("ld.shared.b32 %r1, [%r2];", "memory", "shared", "load", 32),
    ("st.shared.v2.b32 [%r1], {%r2, %r3};", "memory", "shared", "store", 64),
    ("st.shared.v4.b32 \t[%r44+2048], {%r45, %r36, %r46, %r37};", "memory", "shared", "store", 128),
    ("ld.shared::cta.v4.b32 {%r1, %r2, %r3, %r4}, [%r5+16];", "memory", "shared", "load", 128),
    ("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];", "memory", "shared", "load", 128),
    ("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%r1, %r2}, [%r5];", "memory", "shared", "load", 64),
    ("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%r1}, [%r5];", "memory", "shared", "load", 32),
    ("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%r5], {%r1, %r2, %r3, %r4};", "memory", "shared", "store", 128),
    ("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r1, %r2}, %rd1, %rd2, %p1, 1, 1, 0, 1;",
     "matrix", None, None, None),
    ("wgmma.fence.sync.aligned;", "other", None, None, None),
    ("wgmma.commit_group.sync.aligned;", "other", None, None, None),
    ("wgmma.wait_group.sync.aligned 1;", "wait", None, None, None),
    ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f1, %f2, %f3, %f4};",
     "matrix", None, None, None),
    ("bar.sync \t0;", "barrier", None, None, None),
    ("barrier.sync 1, 256;", "barrier", None, None, None),
    ("barrier.cluster.arrive;", "barrier", None, None, None),
    ("mbarrier.init.shared::cta.b64 [%r1], 1;", "other", None, None, None),
    ("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r1], 16384;", "barrier", None, None, None),
    ("mbarrier.try_wait.parity.shared::cta.b64 %p1, [%r1], %r2;", "wait", None, None, None),
    ("@!%p2 mbarrier.test_wait.shared.b64 %p1, [%r1], %rd2;", "wait", None, None, None),
    ("fence.proxy.async.shared::cta;", "other", None, None, None),
    ("ld.param.b64 \t%rd4, [remote_store_param_0];", "memory", "param", "load", 64),
    ("ld.b32 %r1, [%rd1];", "memory", "generic", "load", 32),
    ("ld.local.b32 %r1, [%rd1];", "memory", "local", "load", 32),
    ("st.local.v2.b64 [%rd1], {%rd2, %rd3};", "memory", "local", "store", 128),
    ("ld.const.b32 %r1, [c];", "memory", "const", "load", 32),
    ("prefetch.global.L2 [%rd1];", "memory", "global", "prefetch", None),
    ("multimem.ld_reduce.relaxed.sys.global.add.f32 %f1, [%rd1];", "memory", "multimem", "load", 32),
    ("mov.u32 %r1, %tid.x;", "other", None, None, None),
    ("ret;", "other", None, None, None),
]


@pytest.mark.parametrize("line,category,space,kind,width", PTX_LINES)
def test_ptx_lines(line, category, space, kind, width):
    i = classify(line, "ptx")
    assert (i.category, i.space, i.kind, i.width_bits) == (category, space, kind, width)


SASS_LINES = [
    ("        /*0080*/                   @P0 STG.E.U16 desc[UR4][R2.64], R5 ;   /* 0x0000000502007986 */",
     "memory", "global", "store", 16),
    ("/*0570*/ @!P3 STG.E.U16 desc[UR6][R12.64], R4 ;", "memory", "global", "store", 16),
    ("/*0120*/ @!P0 LDG.E.128 R4, desc[UR6][R16.64] ;", "memory", "global", "load", 128),
    ("LDG.E.128.CONSTANT R4, desc[UR6][R16.64] ;", "memory", "global", "load", 128),
    ("LDG.E.LTC128B.128 R4, desc[UR6][R16.64] ;", "memory", "global", "load", 128),
    ("LDG.E.U8 R4, desc[UR6][R16.64] ;", "memory", "global", "load", 8),
    ("LDG.E.64 R12, desc[UR6][R12.64] ;", "memory", "global", "load", 64),
    ("LDG.E R4, desc[UR6][R16.64] ;", "memory", "global", "load", 32),
    ("STG.E.128 desc[UR4][R2.64+0x800], R8 ;", "memory", "global", "store", 128),
    ("@UP0 STG.E.64 desc[UR4][R2.64], R8 ;", "memory", "global", "store", 64),
    ("LDS R4, [R5] ;", "memory", "shared", "load", 32),
    ("LDS.U16 R4, [R5] ;", "memory", "shared", "load", 16),
    ("LDS.64 R4, [R5] ;", "memory", "shared", "load", 64),
    ("STS.128 [R25+UR4], R16 ;", "memory", "shared", "store", 128),
    ("LDSM.16.M88.4 R4, [R27] ;", "memory", "shared", "load", 128),
    ("LDSM.16.MT88.2 R4, [R27] ;", "memory", "shared", "load", 64),
    ("STSM.16.M88.4 [R27], R4 ;", "memory", "shared", "store", 128),
    ("@!PT LDS RZ, [RZ] ;", "other", None, None, None),
    ("ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU PT, R0, desc[UR4][R2.64], R5 ;", "memory", "global", "atomic", 32),
    ("ATOMG.E.CAS.64.STRONG.SYS PT, R0, desc[UR4][R2.64], R4, R6 ;", "memory", "global", "atomic", 64),
    ("ATOMS.ADD R0, [R2], R5 ;", "memory", "shared", "atomic", 32),
    ("RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R5 ;", "memory", "generic", "atomic", 32),
    ("REDG.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R5 ;", "memory", "global", "atomic", 32),
    ("LDGSTS.E.BYPASS.128 [R3+0x1000], desc[UR14][R24.64], P0 ;", "memory", "global", "async_copy", 128),
    ("LDGSTS.E [R3], desc[UR14][R24.64] ;", "memory", "global", "async_copy", 32),
    ("LDGDEPBAR ;", "other", None, None, None),
    ("UTMALDG.2D [UR8], [UR4] ;", "memory", "tensor", "async_copy", None),
    ("UTMASTG.2D [UR4], [UR8] ;", "memory", "tensor", "async_copy", None),
    ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8].tnspB, R24 ;", "matrix", None, None, None),
    ("HMMA.16816.F32.BF16 R4, R8, R12, R4 ;", "matrix", None, None, None),
    ("BAR.SYNC.DEFER_BLOCKING 0x0 ;", "barrier", None, None, None),
    ("BAR.SYNC 0x0 ;", "barrier", None, None, None),
    ("WARPSYNC 0xffffffff ;", "barrier", None, None, None),
    ("DEPBAR.LE SB0, 0x2 ;", "wait", None, None, None),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", "wait", None, None, None),
    ("WARPGROUP.ARRIVE ;", "other", None, None, None),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x100], R3 ;", "wait", None, None, None),
    ("SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR4+0x100], RZ ;", "barrier", None, None, None),
    ("LDL.64 R2, [R1+0x8] ;", "memory", "local", "load", 64),
    ("STL [R1+0x4], R2 ;", "memory", "local", "store", 32),
    ("ULDC.64 UR4, c[0x0][0x208] ;", "memory", "const", "load", 64),
    ("LDC R1, c[0x0][0x28] ;", "memory", "const", "load", 32),
    ("NOP;", "other", None, None, None),
    ("EXIT ;", "other", None, None, None),
]


@pytest.mark.parametrize("line,category,space,kind,width", SASS_LINES)
def test_sass_lines(line, category, space, kind, width):
    i = classify(line, "sass")
    assert (i.category, i.space, i.kind, i.width_bits) == (category, space, kind, width)


AMD_LINES = [
    ("\tglobal_load_dwordx4 v[0:3], v[4:5], off", "memory", "global", "load", 128),
    ("\tglobal_store_short_d16_hi v[4:5], v3, off offset:2", "memory", "global", "store", 16),
    ("\tglobal_store_short v[4:5], v3, off", "memory", "global", "store", 16),
    ("\tglobal_store_dwordx4 v[4:5], v[0:3], off", "memory", "global", "store", 128),
    ("\tglobal_load_ushort v0, v2, s[0:1]", "memory", "global", "load", 16),
    ("\tglobal_load_ubyte v0, v2, s[0:1]", "memory", "global", "load", 8),
    ("\tbuffer_load_dword v2, v1, s[0:3], 0 offen", "memory", "buffer", "load", 32),
    ("\tbuffer_load_dwordx4 v[2:5], v1, s[0:3], 0 offen", "memory", "buffer", "load", 128),
    ("\tbuffer_load_dword v1, s[4:7], 0 offen lds", "memory", "buffer", "async_copy", 32),
    ("\tbuffer_store_dwordx2 v[2:3], v1, s[0:3], 0 offen", "memory", "buffer", "store", 64),
    ("\tbuffer_atomic_add_f32 v2, v1, s[0:3], 0 offen", "memory", "buffer", "atomic", 32),
    ("\tds_read_b128 v[0:3], v4", "memory", "shared", "load", 128),
    ("\tds_read2_b32 v[0:1], v4 offset1:16", "memory", "shared", "load", 64),
    ("\tds_read2st64_b64 v[0:3], v4 offset1:1", "memory", "shared", "load", 128),
    ("\tds_write2_b64 v4, v[0:1], v[2:3] offset1:16", "memory", "shared", "store", 128),
    ("\tds_write_b16_d16_hi v4, v1", "memory", "shared", "store", 16),
    ("\tds_write_b32 v4, v1 offset:256", "memory", "shared", "store", 32),
    ("\tds_read_b64_tr_b16 v[0:1], v4", "memory", "shared", "load", 64),
    ("\tds_add_u32 v4, v1", "memory", "shared", "atomic", 32),
    ("\tds_bpermute_b32 v1, v2, v3", "other", None, None, None),
    ("\tscratch_store_dword off, v1, s33 offset:4", "memory", "local", "store", 32),
    ("\tscratch_load_dwordx4 v[0:3], off, s33", "memory", "local", "load", 128),
    ("\tflat_load_dword v0, v[0:1]", "memory", "flat", "load", 32),
    ("\tglobal_atomic_add_f32 v0, v1, s[0:1]", "memory", "global", "atomic", 32),
    ("\tglobal_atomic_pk_add_bf16 v0, v1, s[0:1]", "memory", "global", "atomic", 32),
    ("\tglobal_atomic_cmpswap v0, v5, v[4:5], s[6:7] offset:4 sc0", "memory", "global", "atomic", 32),
    ("\tglobal_atomic_cmpswap_x2 v[0:1], v2, v[4:7], s[0:1] glc", "memory", "global", "atomic", 64),
    ("\tglobal_atomic_add_f64 v0, v[1:2], s[0:1]", "memory", "global", "atomic", 64),
    ("\tglobal_load_lds_dwordx4 v1, s[0:1]", "memory", "global", "async_copy", 128),
    ("\tv_mfma_f32_32x32x8_f16 a[0:15], v[0:1], v[2:3], a[0:15]", "matrix", None, None, None),
    ("\tv_mfma_f32_16x16x32_bf16 v[0:3], v[4:7], v[8:11], v[0:3]", "matrix", None, None, None),
    ("\ts_waitcnt vmcnt(0) lgkmcnt(0)", "wait", None, None, None),
    ("\ts_waitcnt_vscnt null, 0x0", "wait", None, None, None),
    ("\ts_barrier", "barrier", None, None, None),
    ("\ts_load_dwordx2 s[2:3], s[0:1], 0x0", "memory", "scalar", "load", 64),
    ("\ts_load_b128 s[4:7], s[0:1], 0x0", "memory", "scalar", "load", 128),
    # RDNA (gfx11) spellings
    ("\tglobal_store_b128 v[4:5], v[0:3], off", "memory", "global", "store", 128),
    ("\tglobal_load_b64 v[0:1], v2, s[0:1]", "memory", "global", "load", 64),
    ("\tglobal_load_u16 v0, v2, s[0:1]", "memory", "global", "load", 16),
    ("\tglobal_store_b16 v[4:5], v3, off", "memory", "global", "store", 16),
    ("\tglobal_store_d16_hi_b16 v[4:5], v3, off offset:2", "memory", "global", "store", 16),
    ("\tds_store_b64 v4, v[0:1]", "memory", "shared", "store", 64),
    ("\tds_load_b128 v[0:3], v4", "memory", "shared", "load", 128),
    ("\tds_load_2addr_b32 v[0:1], v4 offset1:16", "memory", "shared", "load", 64),
    ("\tv_wmma_f32_16x16x16_f16 v[0:7], v[8:15], v[16:23], v[0:7]", "matrix", None, None, None),
    ("\tbuffer_gl0_inv", "other", None, None, None),
    ("\tbuffer_wbl2 sc1", "other", None, None, None),
    ("\tv_add_u32_e32 v0, v1, v2", "other", None, None, None),
    ("\ts_endpgm", "other", None, None, None),
]


@pytest.mark.parametrize("line,category,space,kind,width", AMD_LINES)
def test_amdgcn_lines(line, category, space, kind, width):
    i = classify(line, "amdgcn")
    assert (i.category, i.space, i.kind, i.width_bits) == (category, space, kind, width)


@pytest.mark.parametrize(
    "line,which",
    [
        ("// begin inline asm", "ptx"),
        ("\t.reg .b32 \t%r<5>;", "ptx"),
        ("$L__BB0_2:", "ptx"),
        ("{", "ptx"),
        ("", "ptx"),
        (".visible .entry remote_store(", "ptx"),
        ("        /* 0x000e220000000800 */", "sass"),
        ("\t\tFunction : remote_store", "sass"),
        ("\tcode for sm_90a", "sass"),
        ("\t.headerflags\t@\"EF_CUDA_SM90\"", "sass"),
        ("\t\t..........", "sass"),
        ("; NumVgprs: 5", "amdgcn"),
        (".LBB0_1:", "amdgcn"),
        ("remote_store:                           ; @remote_store", "amdgcn"),
        ("    .vgpr_count:     105", "amdgcn"),
        ("amdhsa.target:   amdgcn-amd-amdhsa--gfx942", "amdgcn"),
        ("\t.amdhsa_next_free_vgpr 105", "amdgcn"),
    ],
)
def test_non_instructions(line, which):
    assert classify(line, which) is None


def test_instr_fields_and_text():
    i = classify("        /*0080*/   @P0 STG.E.U16 desc[UR4][R2.64], R5 ;   /* 0x0000000502007986 */", "sass")
    assert i.line_no == 1
    assert i.mnemonic == "STG.E.U16"
    assert i.text == "@P0 STG.E.U16 desc[UR4][R2.64], R5 ;"
    assert i.bytes == 2
    j = classify("\tglobal_store_short v[4:5], v3, off ; a comment", "amdgcn")
    assert j.text == "global_store_short v[4:5], v3, off"
    with pytest.raises(Exception):
        i.category = "other"  # frozen


def test_parse_line_numbers_and_skips():
    text = "\n".join(
        [
            "// comment",
            "\t.reg .b32 %r<3>;",
            "$L__BB0_1:",
            "\t@%p1 st.global.b16 [ %rd7 + 0 ], { %rs1 };",
            "",
            "\tbar.sync \t0;",
            "\tret;",
        ]
    )
    got = parse(text, "ptx")
    assert [(i.line_no, i.mnemonic, i.category) for i in got] == [
        (4, "st.global.b16", "memory"),
        (6, "bar.sync", "barrier"),
        (7, "ret", "other"),
    ]


def test_unknown_isa():
    for fn in (lambda: parse("x", "gcn"), lambda: mix("x", "SASS"), lambda: classify("x", "llir")):
        with pytest.raises(ValueError) as e:
            fn()
        assert all(name in str(e.value) for name in isa.ISAS)


def test_isa_of_stage():
    assert [isa_of_stage(s) for s in ("ptx", "sass", "amdgcn")] == ["ptx", "sass", "amdgcn"]
    for bad in ("cubin", "ttgir", "llir", "hsaco", "json", ""):
        with pytest.raises(ValueError):
            isa_of_stage(bad)


# --------------------------------------------------------------------------
# mix(): the table


def test_mix_columns_order_and_bytes():
    text = "\n".join(
        [
            "\ts_waitcnt vmcnt(0)",
            "\tglobal_store_short v[4:5], v3, off",
            "\tglobal_store_short_d16_hi v[4:5], v3, off offset:2",
            "\tglobal_store_short v[4:5], v3, off offset:4",
            "\tglobal_load_dwordx4 v[0:3], v[4:5], off",
            "\tv_mfma_f32_32x32x8_f16 a[0:15], v[0:1], v[2:3], a[0:15]",
            "\ts_barrier",
            "\ts_barrier",
            "\tv_add_u32_e32 v0, v1, v2",
        ]
    )
    df = mix(text, "amdgcn")
    assert list(df.columns) == list(isa.MIX_COLUMNS)
    assert df[["category", "space", "kind"]].fillna("-").values.tolist() == [
        ["barrier", "-", "-"],
        ["matrix", "-", "-"],
        ["memory", "global", "load"],
        ["memory", "global", "store"],
        ["wait", "-", "-"],
    ]
    assert df["count"].tolist() == [2, 1, 1, 3, 1]
    assert df.width_bits.tolist()[2:4] == [128, 16]
    assert df.bytes_per_thread.tolist() == [0.0, 0.0, 16.0, 6.0, 0.0]
    assert df.mnemonics.iloc[3] == "global_store_short:2, global_store_short_d16_hi:1"
    assert str(df.width_bits.dtype) == "Int64"
    other = mix(text, "amdgcn", include_other=True)
    assert rows(other, category="other")["count"].tolist() == [1]


def test_opcodes_count_every_instruction_by_operation():
    sass = "\n".join([
        "        /*0000*/                   PRMT R4, R2, 0x7632, R3 ;",
        "        /*0010*/              @P0  PRMT R5, R2, 0x5410, R3 ;",
        "        /*0020*/                   LOP3.LUT R6, R4, 0x81c081c0, RZ, 0xc0, !PT ;",
        "        /*0030*/                   STG.E.128 desc[UR4][R8.64], R4 ;",
        "        /*0040*/                   STG.E.U16 desc[UR4][R8.64+0x10], R4 ;",
        "        /*0050*/                   WARPGROUP.ARRIVE ;",
        "        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "        /*0070*/              @!PT LDS.128 RZ, [RZ] ;",
    ])
    df = isa.opcodes(sass, "sass")
    assert list(df.columns) == ["opcode", "count", "category"]
    got = {r.opcode: (r.count, r.category) for r in df.itertuples()}
    assert got == {"PRMT": (2, "other"), "STG": (2, "memory"), "WARPGROUP": (2, "other+wait"),
                   "LOP3": (1, "other"), "LDS": (1, "other")}          # @!PT: never run, 'other' as in mix
    assert df.opcode.tolist()[:3] == ["PRMT", "STG", "WARPGROUP"]       # most frequent first, then by name
    ptx = "\tprmt.b32 %r1, %r2, 0, 0x4140;\n\tst.global.v4.b32 [%rd1], {%r1, %r2, %r3, %r4};\n\tshl.b32 %r5, %r1, 7;\n"
    assert dict(zip(*isa.opcodes(ptx, "ptx")[["opcode", "count"]].values.T)) == {"prmt": 1, "st": 1, "shl": 1}
    amd = "\tv_perm_b32 v1, v2, v3, v4\n\tglobal_store_dwordx4 v[4:5], v[0:3], off\n\tv_perm_b32 v5, v2, v3, v4\n"
    df = isa.opcodes(amd, "amdgcn")
    assert df.opcode.tolist() == ["v_perm_b32", "global_store_dwordx4"] and df["count"].tolist() == [2, 1]
    assert isa.opcodes("", "sass").empty
    # every instruction mix() counts (its 'other' row included) is in one opcode row
    text = fixture("gemm_bf16_sm90.sass")
    assert isa.opcodes(text, "sass")["count"].sum() == mix(text, "sass", include_other=True)["count"].sum()


def test_mix_unknown_width_gives_nan_bytes():
    df = mix("UTMALDG.2D [UR8], [UR4] ;\nUTMALDG.2D [UR8], [UR6] ;\n", "sass")
    assert df["count"].tolist() == [2]
    assert pd.isna(df.width_bits.iloc[0]) and pd.isna(df.bytes_per_thread.iloc[0])


def test_mix_empty():
    df = mix("", "sass")
    assert df.empty and list(df.columns) == list(isa.MIX_COLUMNS)


def test_mix_is_deterministic():
    text = fixture("gemm_bf16_sm90.sass")
    a, b = mix(text, "sass"), mix("\n".join(reversed(text.splitlines())), "sass")
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize("name", sorted(p.name for p in FIX.iterdir() if p.suffix[1:] in isa.ISAS))
def test_tally_agrees_with_parse(name):
    which = name.rsplit(".", 1)[1]
    text = fixture(name)
    by_parse = Counter((i.category, i.space, i.kind, i.width_bits) for i in parse(text, which))
    by_tally = {k: sum(c.values()) for k, c in tally(text, which).items()}
    assert by_parse == by_tally
    assert sum(by_parse.values()) > 10


def test_crlf_text():
    text = fixture("remote_store_nohint_sm90.ptx")
    crlf = text.replace("\n", "\r\n")
    pd.testing.assert_frame_equal(mix(text, "ptx"), mix(crlf, "ptx"))
    assert len(parse(crlf, "ptx")) == len(parse(text, "ptx"))


# --------------------------------------------------------------------------
# Bad input: truncated assembly


def test_truncated_mid_line():
    text = fixture("remote_store_hint_sm90.ptx")
    cut = text.index("st.global.v4.b32") + len("st.global.v4.b")
    trunc = text[:cut]
    got = parse(trunc, "ptx")
    last = got[-1]
    assert last.mnemonic == "st.global.v4.b"
    assert (last.category, last.space, last.kind) == ("memory", "global", "store")
    assert last.width_bits is None
    df = mix(trunc, "ptx")
    assert rows(df, space="global", kind="store")["count"].tolist() == [1]


@pytest.mark.parametrize("name", ["remote_store_nohint_sm90.sass", "gemm_bf16_gfx942.amdgcn", "gemm_bf16_sm90.ptx"])
def test_truncated_anywhere_does_not_crash(name):
    which = name.rsplit(".", 1)[1]
    text = fixture(name)
    full = len(parse(text, which))
    for frac in (0.0, 0.13, 0.5, 0.77, 0.999):
        cut = text[: int(len(text) * frac)]
        n = len(parse(cut, which))
        assert n <= full
        assert int(mix(cut, which, include_other=True)["count"].sum()) == n


# --------------------------------------------------------------------------
# Speed and import weight


def test_mix_is_fast_on_100kb():
    parts = [fixture("gemm_bf16_sm90.sass")]
    text = ("".join(parts) * 8)[:100_000]
    mix(text, "sass")
    best = min(_timed(lambda: mix(text, "sass")) for _ in range(7))
    # ~2 ms on a slow shared core; leave room for a busy machine.
    assert best < 0.03, f"mix() took {best * 1e3:.1f} ms on 100 KB"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_isa_imports_neither_torch_nor_triton():
    code = (
        "import sys, workbench.asm.isa\n"
        "bad = [m for m in ('torch', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env)


# --------------------------------------------------------------------------
# Live cross-compiles for the targets without fixtures (and a drift check).


@pytest.fixture(scope="module")
def fixtures_module(isa_fixture_kernels):
    return isa_fixture_kernels


@pytest.mark.parametrize(
    "target,hint,expected",
    [
        ("sm100", False, {"ptx": {16: 16}, "sass": {16: 16}}),
        ("sm100", True, {"ptx": {128: 2}, "sass": {128: 2}}),
        ("gfx950", False, {"amdgcn": {16: 8}}),
        ("gfx950", True, {"amdgcn": {128: 1}}),
        ("sm90", True, {"ptx": {128: 2}, "sass": {128: 2}}),
        ("gfx942", False, {"amdgcn": {16: 8}}),
    ],
)
def test_live_cross_compile(fixtures_module, tmp_path, monkeypatch, target, hint, expected):
    from workbench.asm import tools

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    k = fixtures_module.compile_remote_store(fixtures_module.TARGETS[target], hint)
    for which, widths in expected.items():
        if which == "sass":
            cubin = tmp_path / "k.cubin"
            cubin.write_bytes(k.asm["cubin"])
            try:
                text = tools.sass_from_cubin(cubin)
            except tools.ToolMissing as e:
                pytest.skip(str(e))
        else:
            text = k.asm[which]
        assert global_stores(text, which) == widths, (target, hint, which)
    if target == "gfx950":
        names = Counter(
            i.mnemonic for i in parse(k.asm["amdgcn"], "amdgcn") if i.kind == "store" and i.space == "global"
        )
        assert names == (
            {"global_store_dwordx4": 1} if hint else {"global_store_short": 4, "global_store_short_d16_hi": 4}
        )


@pytest.mark.parametrize(
    "text,which,expected",
    [
        (
            "\t@%p1 cp.async.cg.shared.global [ %r17 + 0 ], [ %rd17 + 0 ], 0x10, %r18;\n"
            "\tcp.async.ca.shared.global [ %r17 + 0 ], [ %rd17 + 0 ], 4;\n"
            "\tcp.async.cg.shared.global [ %r17 + 0 ], [ %rd17 + 0 ], 16;\n"
            "\tcp.async.cg.shared.global [ %r17 + 0 ], [ %rd1",  # cut mid-line
            "ptx",
            {128: 2, 32: 1, None: 1},
        ),
        (
            "\tbuffer_load_dword v1, s[4:7], 0 offen lds\n"
            "\tbuffer_load_dword v1, s[4:7], 0 offen\n"
            "\tbuffer_load_dwordx4 v1, s[4:7], 0 offen lds ; comment\n"
            "\tbuffer_load_dword v1, s[4:7], 0 offen ; lds only in a comment\n",
            "amdgcn",
            {("async_copy", 32): 1, ("async_copy", 128): 1, ("load", 32): 2},
        ),
    ],
)
def test_operand_dependent_lines(text, which, expected):
    by_parse = Counter(
        (i.width_bits if which == "ptx" else (i.kind, i.width_bits)) for i in parse(text, which)
    )
    assert by_parse == expected
    by_tally = Counter()
    for (cat, space, kind, width), c in tally(text, which).items():
        by_tally[width if which == "ptx" else (kind, width)] += sum(c.values())
    assert by_tally == expected
