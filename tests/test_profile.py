"""Hardware counters per source line (workbench.profile, `workbench profile`, `asm lines/diff --counters`).

Fixtures, all made on one H200 by ncu 2025.3.1 (tests/fixtures/make_profile_fixtures.py,
experiments/probes/adopt_ncu_reports.py, results/profiles/README.md):
tests/fixtures/profiles/ (put: a Triton kernel through nested inlined helpers; put_noline: the same
compiled with TRITON_DISABLE_LINE_INFO=1; torch_mm: a cuBLAS kernel, no Triton source), each with
ncu's own per-instruction CSV (the ground truth), and results/profiles/ (the ISA-hints pair, the
GEMMs, the MXFP4 kernel) that the notebooks show. Corrupt, truncated and foreign reports are made
here from them. The GPU test profiles a small kernel and compares with ncu's CSV on the node.
"""
from __future__ import annotations

import csv
import json
import os
import random
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from workbench.asm.cache import get_entry
from workbench.profile import ProfileError, load
from workbench.profile import lines as PL
import workbench.profile.report as report_module
from workbench.profile.report import CSV_COLUMNS, ncu_csv_column, reader_missing

# collected everywhere (tests/test_gpu_collection.py), skipped with the reason where the reader is missing
pytestmark = pytest.mark.skipif(reader_missing() is not None, reason=str(reader_missing()))

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures" / "profiles"
HINTS = REPO / "results" / "profiles" / "isa_hints"
GLUON = REPO / "results" / "profiles" / "gemm_tiling" / "gluon.ncu-rep"
CASES = ("put", "put_noline", "torch_mm")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _cli(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "workbench.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env or ENV, timeout=timeout)


@pytest.fixture(scope="module")
def profiles():
    return {c: load(FIX / f"{c}.ncu-rep") for c in CASES}


def _ncu_csv(path: Path) -> pd.DataFrame:
    """ncu's `--page source --csv --print-source sass` table: one row per SASS instruction, by address."""
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))[1:]  # the first line names the kernel
    df = pd.DataFrame(rows[1:], columns=rows[0])
    df["pc"] = [int(a, 16) for a in df["Address"]]
    return df


def _line_of(text: str, needle: str) -> int:
    hits = [i for i, s in enumerate(text.splitlines(), 1) if needle in s]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


def _number(s: str) -> float:
    return 0.0 if s in ("", "-") else float(s.replace(",", ""))


# -- the numbers are ncu's ------------------------------------------------------------


def _compare_with_ncu(prof, table: pd.DataFrame) -> int:
    """Every per-PC column equals ncu's CSV (a column the CSV lacks is zero there); returns columns compared."""
    ours = prof.pcs.set_index("pc")
    assert sorted(ours.index) == sorted(table["pc"]), "the same SASS instructions, one row each"
    theirs = table.set_index("pc").loc[ours.index]
    assert [a.split()[0] for a in ours["sass"]] == [b.split()[0] for b in theirs["Source"]]
    compared = 0
    for col in ours.columns:
        name = ncu_csv_column(col)
        if name is None:
            continue
        if name not in theirs.columns:  # the fixture leaves out ncu's all-zero columns
            assert (ours[col] == 0).all(), col
            continue
        got, want = ours[col].astype(float).tolist(), [_number(v) for v in theirs[name]]
        assert got == want, (col, name, [(hex(pc), g, w) for pc, g, w in zip(ours.index, got, want) if g != w][:5])
        compared += 1
    return compared


@pytest.mark.parametrize("case", CASES)
def test_per_pc_counters_equal_ncus_own_csv(profiles, case):
    prof = profiles[case]
    compared = _compare_with_ncu(prof, _ncu_csv(FIX / f"{case}.sass.csv"))
    assert compared >= 8  # samples, not issued, instructions executed, thread instructions, stall reasons ...
    assert prof.pcs["samples"].sum() > 1000 and len(prof.reasons) >= 18


@pytest.mark.parametrize("case", CASES)
def test_per_line_samples_add_up_to_the_kernel_total(profiles, case):
    prof = profiles[case]
    table = PL.line_table(prof)
    # the report's own kernel totals (ncu's sums over its instances), and ncu's CSV
    csvt = _ncu_csv(FIX / f"{case}.sass.csv")
    for col in ("samples", "samples_not_issued", "inst_executed"):
        assert table[col].sum() == prof.totals[col] == sum(_number(v) for v in csvt[CSV_COLUMNS[col]]), col
    assert table["share"].sum() == pytest.approx(1.0)
    assert table["instructions"].sum() == (prof.pcs["sass"] != "").sum()
    for r in prof.reasons:
        assert table[f"stall_{r}"].sum() == prof.pcs[f"stall_{r}"].sum()


# -- lines, helpers, no lines ----------------------------------------------------------


def test_inlined_helpers_keep_their_line_and_call_site(profiles):
    prof = profiles["put"]
    entry = get_entry(json.loads((FIX / "put.json").read_text())["hash"], FIX / "put.triton-cache")
    attr = PL.join_entry(prof, entry)
    table = PL.line_table(prof, attr).set_index("line")
    (src,) = prof.sources.values()  # the remote.py that was profiled, embedded in the report
    translate = _line_of(src, "offset = ptr.to(tl.uint64, bitcast=True) - from_base")
    store = _line_of(src, "tl.store(translate(ptr, rank, peer, heap_bases, HINT), value, mask=mask)")
    put_call = _line_of(src, "remote_store(dst_ptr, value, rank, peer, heap_bases, mask, HINT)")
    kernel_call = _line_of(src, "put(src_ptr + offs, dst_ptr + offs")
    assert table.loc[translate, "via"] == f"remote.py:{store} < remote.py:{put_call} < remote.py:{kernel_call}"
    assert "global store 128-bit x2" in table.loc[store, "mix"]
    assert table.loc[store, "source"].strip().startswith("tl.store(translate(")
    # the kernel's call line carries everything inlined below it; the helper lines their own cost
    inlined = table[table["via"].str.contains(f"remote.py:{kernel_call}")]
    assert table.loc[kernel_call, "calls_samples"] == inlined["samples"].sum() > 0.9 * prof.total_samples
    # without the entry: the report's own (innermost) lines, the same per-line counts
    plain = PL.line_table(prof).set_index("line")
    assert (plain["samples"] == table["samples"]).all() and not plain["via"].any()


def test_a_kernel_without_line_info_is_one_row_that_says_why(profiles):
    prof = profiles["put_noline"]
    assert not prof.line_info
    table = PL.line_table(prof)
    assert len(table) == 1 and pd.isna(table["line"].iloc[0]) and table["source"].iloc[0] == "(no line info)"
    assert table["samples"].iloc[0] == prof.totals["samples"]
    assert "TRITON_DISABLE_LINE_INFO=1" in PL.no_line_note(prof)
    res = _cli("profile", "show", FIX / "put_noline.ncu-rep")
    assert res.returncode == 0, res.stderr
    assert "(no line info)" in res.stdout and "TRITON_DISABLE_LINE_INFO=1" in res.stdout


def test_a_library_kernel_has_no_triton_source(profiles):
    prof = profiles["torch_mm"]
    assert prof.name.startswith("nvjet") and not prof.sources and not prof.line_info
    assert json.loads((FIX / "torch_mm.json").read_text())["hash"] is None
    res = _cli("profile", "show", FIX / "torch_mm.ncu-rep", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["entry"] is None and len(out["rows"]) == 1 and out["rows"][0]["samples"] == out["totals"]["samples"]
    assert "warpgroup_arrive" in out["rows"][0]["reasons"]  # sampled, though ncu's CSV has no column for it


def test_show_text_and_json(profiles):
    res = _cli("profile", "show", FIX / "put.ncu-rep")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "put_kernel" in out and "lines and call sites from Triton cache entry QQZPKJTQM53B" in out
    assert "56 SASS instructions" in out  # the entry's, every one of them
    assert re.search(r"tl\.store\(translate\(.*global store|88\.\d%\s+long scoreboard", out), out
    assert "inlined, called from remote.py:" in out and "in the helpers it inlines" in out
    total = next(line for line in out.splitlines() if line.strip().startswith("total"))
    assert f"{profiles['put'].total_samples:,}" in total
    js = json.loads(_cli("profile", "show", FIX / "put.ncu-rep", "--json").stdout)
    assert sum(r["samples"] for r in js["rows"]) == js["totals"]["samples"] == profiles["put"].total_samples
    assert js["entry"]["hash"].startswith("QQZPKJTQM53B")
    store = max(js["rows"], key=lambda r: r["samples"])
    assert store["reasons"] and next(iter(store["reasons"])) == "long_scoreboard"
    assert store["l2_sectors_global"] > 0 and store["via"]


def test_show_by_pc(profiles):
    res = _cli("profile", "show", FIX / "put.ncu-rep", "--by", "pc", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["rows"]
    prof = profiles["put"]
    assert [r["offset"] for r in rows] == list(prof.pcs["offset"])
    assert [r["samples"] for r in rows] == list(prof.pcs["samples"])
    stg = [r for r in rows if r["mnemonic"].startswith("STG")]
    assert len(stg) == 2 and all(r["width_bits"] == 128 and len(r["via"]) == 2 for r in stg)
    text = _cli("profile", "show", FIX / "put.ncu-rep", "--by", "pc").stdout
    assert "STG.E.128" in text and "remote.py:" in text


def test_without_the_reports_sass_the_entry_gives_the_instructions(profiles):
    """`profile show` leaves the report's SASS text out (its disassembly is most of the reading time); the
    cache entry then gives the instructions, checked against ncu's per-opcode executed counts."""
    lean = load(FIX / "put.ncu-rep", sass=False)
    assert not lean.has_sass and lean.pcs["sass"].isna().all() and lean.opcodes["STG"] == 65536
    assert lean.pcs["samples"].sum() == profiles["put"].total_samples
    assert PL.line_table(lean)["instructions"].isna().all()  # unknown without text or entry
    entry = get_entry(json.loads((FIX / "put.json").read_text())["hash"], FIX / "put.triton-cache")
    full = PL.line_table(profiles["put"], PL.join_entry(profiles["put"], entry))
    joined = PL.line_table(lean, PL.join_entry(lean, entry))
    cols = ["line", "via", "instructions", "mix", "inst_executed", "samples", "samples_not_issued", "calls_samples"]
    pd.testing.assert_frame_equal(joined[cols], full[cols])
    other = get_entry(json.loads((HINTS / "hint1.json").read_text())["hash"], HINTS / "hint1.triton-cache")
    with pytest.raises(ProfileError, match="instructions executed per opcode differ"):
        PL.join_entry(lean, other)


def test_an_entry_of_another_kernel_is_refused(profiles):
    other = get_entry(json.loads((HINTS / "hint0.json").read_text())["hash"], HINTS / "hint0.triton-cache")
    with pytest.raises(ProfileError, match="is not the kernel put_kernel"):
        PL.join_entry(profiles["put"], other)
    res = _cli("profile", "show", FIX / "put.ncu-rep", "--entry", other.path)
    assert res.returncode == 2 and "is not the kernel put_kernel" in res.stderr and "Traceback" not in res.stderr


def test_more_kernels_than_one_and_a_wrong_pick():
    res = _cli("profile", "show", FIX / "put.ncu-rep", "--kernel", "nope")
    assert res.returncode == 2 and "matches none of the report's kernels: put_kernel" in res.stderr
    res = _cli("profile", "show", FIX / "put.ncu-rep", "--kernel", "3")
    assert res.returncode == 2 and "holds 1 kernel(s)" in res.stderr


# -- untrusted reports -------------------------------------------------------------------


def _bad_reports(tmp: Path) -> dict[str, tuple[Path, str]]:
    good = (FIX / "put.ncu-rep").read_bytes()
    made = {}

    def put(name, data, why):
        p = tmp / name
        p.write_bytes(data)
        made[name] = (p, why)

    for cut in (6, 100, 20_000, len(good) // 2, len(good) - 1):
        put(f"truncated_{cut}.ncu-rep", good[:cut], "truncated or corrupt|not an Nsight Compute report")
    mid = len(good) // 2
    put("zeroed_payload.ncu-rep", good[:mid] + bytes(4096) + good[mid + 4096:], "no name|no kernel|cannot be read")
    d = bytearray(good)
    d[150:160] = b"\xff" * 10
    put("broken_header.ncu-rep", bytes(d), "truncated or corrupt")
    put("appended.ncu-rep", good + b"trailing bytes", "truncated or corrupt")
    put("empty.ncu-rep", b"", "not an Nsight Compute report")
    put("zip.ncu-rep", b"PK\x03\x04" + bytes(200), "not an Nsight Compute report")
    put("nsys.nsys-rep", b"SQLite format 3\x00" + bytes(200), "not an Nsight Compute report")
    put("text.ncu-rep", b"ID,Kernel Name\n1,put_kernel\n", "not an Nsight Compute report")
    return made


def test_corrupt_truncated_and_foreign_reports_get_a_clear_error(tmp_path):
    for name, (path, why) in _bad_reports(tmp_path).items():
        with pytest.raises(ProfileError, match=why) as info:
            load(path)
        assert str(path) in str(info.value), name
    res = _cli("profile", "show", tmp_path / "truncated_20000.ncu-rep")
    assert res.returncode == 2 and res.stderr.startswith("error: ") and "Traceback" not in res.stderr
    assert "truncated" in res.stderr and "profile again or copy the whole file" in res.stderr


def test_randomly_damaged_reports_never_crash_the_caller(tmp_path):
    """Bytes flipped anywhere: a clear ProfileError or a readable profile, never another exception or a hang."""
    good = (FIX / "put.ncu-rep").read_bytes()
    rng = random.Random(41)
    outcomes = {"error": 0, "read": 0}
    for i in range(12):
        d = bytearray(good)
        for _ in range(rng.choice([1, 8, 64])):
            d[rng.randrange(8, len(d))] = rng.randrange(256)
        p = tmp_path / f"damaged_{i}.ncu-rep"
        p.write_bytes(bytes(d))
        try:
            prof = load(p)
        except ProfileError as exc:
            assert str(p) in str(exc)
            outcomes["error"] += 1
        else:
            assert (prof.pcs["samples"] >= 0).all()
            outcomes["read"] += 1
    assert sum(outcomes.values()) == 12


def test_huge_files_directories_and_fifos_are_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_PROFILE_MAX_MB", "0.05")
    with pytest.raises(ProfileError, match="over the 0 MiB a report may have here"):
        load(FIX / "put.ncu-rep")
    monkeypatch.delenv("WORKBENCH_PROFILE_MAX_MB")
    with pytest.raises(ProfileError, match="is a directory"):
        load(tmp_path)
    fifo = tmp_path / "fifo.ncu-rep"
    os.mkfifo(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(ProfileError, match="not a regular file"):
        load(fifo)
    with pytest.raises(ProfileError, match="no such report"):
        load(tmp_path / "missing.ncu-rep")


def test_a_missing_reader_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ncu_report" else real(name, *a))
    with pytest.raises(ProfileError, match=r"pip install 'ncu-report==2026\.3\.1'"):
        load(FIX / "put.ncu-rep")


def test_a_reader_past_its_deadline_is_stopped(monkeypatch, tmp_path):
    # a reader that hangs (as on a damaged report): stopped at the deadline, whatever this machine's speed
    hung = tmp_path / "hung_reader.py"
    hung.write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setattr(report_module, "READER", hung)
    monkeypatch.setenv("WORKBENCH_PROFILE_TIMEOUT_S", "0.001")
    t0 = time.monotonic()
    with pytest.raises(ProfileError, match="did not finish in 0 s and was stopped"):
        load(GLUON)
    assert time.monotonic() - t0 < 30


# -- joined with the inspector -----------------------------------------------------------


def _hint(n: int):
    summary = json.loads((HINTS / f"hint{n}.json").read_text())
    return get_entry(summary["hash"], HINTS / summary["cache"]), HINTS / f"hint{n}.ncu-rep"


def test_asm_lines_counters():
    entry, report = _hint(1)
    res = _cli("asm", "lines", entry.path, "--stage", "sass", "--counters", report, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    prof = load(report)
    assert sum(r["samples"] for r in out["counters"]) == prof.totals["samples"]
    (src,) = prof.sources.values()
    store = _line_of(src, "tl.store(dst, x, mask=mask)")
    row = next(r for r in out["counters"] if r["line"] == store)
    assert row["share"] > 0.5 and row["top_reasons"].startswith("long scoreboard")
    text = _cli("asm", "lines", entry.path, "--stage", "sass", "--counters", report).stdout
    line = next(x for x in text.splitlines() if "tl.store(dst, x, mask=mask)" in x)
    assert "long scoreboard" in line and "global store 128-bit x2" in line


def test_asm_diff_by_line_counters_on_the_hint_pair():
    (a, ra), (b, rb) = _hint(0), _hint(1)
    res = _cli("asm", "diff", a.path, b.path, "--by-line", "--stage", "sass", "--counters", ra, rb, "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["counters"]
    src = load(rb).sources
    store = _line_of(next(iter(src.values())), "tl.store(dst, x, mask=mask)")
    row = next(r for r in rows if r["line"] == store)
    # 16 x 16-bit stores (and a trip through shared memory) -> 2 x 128-bit: 8x fewer store instructions executed,
    # the same L2 traffic, and the store line's share of the samples rises once the load stops dominating
    assert row["inst_executed_a"] > 8 * row["inst_executed_b"] > 0
    assert row["l2_sectors_global_a"] == row["l2_sectors_global_b"] > 0
    assert row["share_b"] > row["share_a"] and row["samples_b"] > row["samples_a"]
    text = _cli("asm", "diff", a.path, b.path, "--by-line", "--stage", "sass", "--counters", ra, rb).stdout
    assert "whose measured cost changed" in text
    assert re.search(r"remote\.py:\d+ `tl\.store\(dst, x, mask=mask\)`: samples [\d,]+ \([\d.]+%\) -> ", text)
    res = _cli("asm", "diff", a.path, b.path, "--counters", ra, rb)
    assert res.returncode == 2 and "--by-line" in res.stderr


def test_widget_and_report_html_carry_the_counters_offline():
    from workbench.profile.html import profile_html, top_lines_figure
    from workbench.widgets import IsaDiffWidget

    (a, ra), (b, rb) = _hint(0), _hint(1)
    pa, pb = load(ra), load(rb)
    w = IsaDiffWidget({"no hint": a, "hint": b}, a="no hint", b="hint", stage="sass", context="memory",
                      counters={"no hint": pa, b.hash: rb})
    page = w.to_html()
    assert "A stalls" in page and "B stalls" in page
    cells = re.findall(r'<td class="wb-stall" data-share="([\d.]+)" style="background:([^"]+)" title="([^"]*)">'
                       r"([^<]*)</td>", page)
    assert len(cells) >= 10
    store = _line_of(next(iter(pb.sources.values())), "tl.store(dst, x, mask=mask)")
    share_b = PL.line_table(pb).set_index("line").loc[store, "share"]
    assert any(abs(float(s) - share_b) < 1e-4 and "long scoreboard" in t and "L2 sectors (global)" in t
               for s, _, t, _ in cells)
    assert "<script src" not in page and "http" not in page  # nothing to fetch: works offline
    single = profile_html(pb)
    assert single.count('class="wb-line"') == len(PL.line_table(pb)) and "stalls: long scoreboard" in single
    fig = top_lines_figure(pb, n=3)
    assert len(fig.data) >= 1 and "tl.store(dst, x, mask=mask)" in " ".join(map(str, fig.data[0].y))


# -- profile run (a stand-in ncu on CPU; the real one in the GPU test) ---------------------


def _fake_ncu(tmp: Path, body: str) -> Path:
    exe = tmp / "ncu"
    exe.write_text(f"#!{sys.executable}\n" + body)
    exe.chmod(0o755)
    return exe


FAKE_NCU = r'''
import os, shutil, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\nVersion 2099.1 (stand-in)"); sys.exit(0)
open(os.environ["FAKE_NCU_ARGS"], "w").write("\n".join(args))
fix = os.environ["FAKE_NCU_FIXTURE"]
cache = os.environ["TRITON_CACHE_DIR"]
os.makedirs(cache, exist_ok=True)
for d in os.listdir(fix + ".triton-cache"):
    shutil.copytree(os.path.join(fix + ".triton-cache", d), os.path.join(cache, d), dirs_exist_ok=True)
shutil.copyfile(fix + ".ncu-rep", args[args.index("-o") + 1] + ".ncu-rep")
print('==PROF== Profiling "put_kernel": 0%....50%....100% - 33 passes')
'''


def test_profile_run_writes_the_report_and_names_the_cache_entry(tmp_path):
    ncu = _fake_ncu(tmp_path, FAKE_NCU)
    env = {**ENV, "FAKE_NCU_ARGS": str(tmp_path / "args"), "FAKE_NCU_FIXTURE": str(FIX / "put")}
    res = _cli("profile", "run", "experiments/profile_cases.py:put", "--kernel", "put_kernel", "--launch", "2",
               "--out", tmp_path / "out", "--ncu", ncu, env=env)
    assert res.returncode == 0, res.stderr + res.stdout
    args = (tmp_path / "args").read_text().splitlines()
    joined = " ".join(args)
    for want in ("--clock-control none", "--section SourceCounters", "--section WarpStateStats",
                 "--section MemoryWorkloadAnalysis_Tables", "--import-source yes", "--launch-skip 1",
                 "--launch-count 1", "-k regex:put_kernel",
                 "-m workbench.profile.target experiments/profile_cases.py:put"):
        assert want in joined, want
    summary = json.loads((tmp_path / "out" / "put.json").read_text())
    assert summary["hash"].startswith("QQZPKJTQM53B") and summary["cache"] == "put.triton-cache"
    assert summary["kernel"] == "put_kernel" and summary["ncu_version"] == "Version 2099.1 (stand-in)"
    assert summary["totals"]["samples"] == load(FIX / "put.ncu-rep").totals["samples"]
    # the summary names no machine's paths for its programs: ncu and Python by name
    assert summary["ncu"] == "ncu" and summary["command"].startswith("ncu --clock-control none")
    assert "python3 -m workbench.profile.target experiments/profile_cases.py:put" in summary["command"]
    show = _cli("profile", "show", tmp_path / "out" / "put.ncu-rep")
    assert show.returncode == 0 and "lines and call sites from Triton cache entry QQZPKJTQM53B" in show.stdout


def test_the_summarys_command_is_portable(tmp_path):
    from workbench.profile.run import portable_command

    cmd = ["/opt/cuda/bin/ncu", "-o", str(tmp_path / "out" / "r"), sys.executable, "-m", "x", "/elsewhere/f"]
    assert portable_command(cmd, cwd=tmp_path) == "ncu -o out/r python3 -m x /elsewhere/f"


@pytest.mark.parametrize("body,message", [
    ("import sys\nprint('==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU "
     "Performance Counters')\nsys.exit(1)\n", "not open to this user (ERR_NVGPUCTRPERM): run as root"),
    ("print('==WARNING== No kernels were profiled.')\n", "ncu profiled no kernel"),
    ("import sys\nprint('Traceback (most recent call last): boom')\nsys.exit(3)\n",
     "the profiled program exited with 3"),
])
def test_profile_run_failures_say_what_to_do(tmp_path, body, message):
    ncu = _fake_ncu(tmp_path, body)
    res = _cli("profile", "run", "experiments/profile_cases.py:put", "--out", tmp_path / "out", "--ncu", ncu)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr and res.stderr.startswith("error: ")
    assert "Traceback (most recent call last):\n" not in res.stderr  # ours; the program's own log tail may quote one


def test_a_summary_without_the_reader_says_what_to_install(tmp_path, monkeypatch):
    import shutil

    from workbench.profile import report as R
    from workbench.profile.run import write_summary

    shutil.copyfile(FIX / "put.ncu-rep", tmp_path / "put.ncu-rep")
    monkeypatch.setattr(R, "reader_missing", lambda: R.INSTALL_HINT)
    summary = write_summary(tmp_path / "put.ncu-rep", None, {"command": "ncu ..."})
    assert summary["kernel"] is None and "pip install 'ncu-report==2026.3.1'" in summary["entry_note"]
    assert json.loads((tmp_path / "put.json").read_text())["command"] == "ncu ..."


def test_profile_run_without_ncu(tmp_path):
    env = {**ENV, "PATH": str(tmp_path)}
    env.pop("NCU", None)
    from workbench.profile import run as R

    if any(Path(p).exists() for pattern in R.NCU_PLACES for p in __import__("glob").glob(pattern)):
        pytest.skip("this machine has ncu installed")
    res = _cli("profile", "run", "experiments/profile_cases.py:put", "--out", tmp_path / "out", env=env)
    assert res.returncode == 2 and "ncu (Nsight Compute) not found" in res.stderr
    res = _cli("profile", "run", "no/such/script.py:f", "--out", tmp_path / "out", env=env)
    assert res.returncode == 2 and "no/such/script.py: no such script" in res.stderr


# -- the Gluon GEMM: the largest kernel -----------------------------------------------------


def test_show_on_the_gluon_gemm_is_quick():
    """Goal: at most 2 s end to end on the 2-core CPU machine (results/profiles/README.md has the times).

    Checked on the CPU time of the whole command (the CLI and the reader it starts, both waited for: an
    upper bound of the wall time on an otherwise idle 2-core machine, where the two overlap), which a
    machine shared with other jobs does not inflate the way it does the wall time. Best of three, against
    $WORKBENCH_PROFILE_SHOW_BUDGET_S (default 2 s)."""
    import resource

    budget = float(os.environ.get("WORKBENCH_PROFILE_SHOW_BUDGET_S", "2"))
    best_cpu = best_wall = float("inf")
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        res = _cli("profile", "show", GLUON)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert res.returncode == 0, res.stderr
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best_cpu, best_wall = min(best_cpu, cpu), min(best_wall, wall)
    assert "_gemm_ws_dev_kernel" in res.stdout
    print(f"workbench profile show {GLUON.name}: best of 3: {best_cpu:.2f} s CPU, {best_wall:.2f} s wall "
          f"(load average {os.getloadavg()[0]:.1f})")
    assert best_cpu <= budget


# -- on a GPU node ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_profile_run_on_a_small_kernel_matches_ncus_csv(tmp_path):
    from workbench.profile.run import find_ncu

    if find_ncu() is None:
        pytest.skip("ncu (Nsight Compute) is not installed on this node")
    res = _cli("profile", "run", "tests/fixtures/profile_target.py:run", "--kernel", "_lines_kernel",
               "--out", tmp_path, "--csv", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "run.json").read_text())
    assert summary["kernel"] == "_lines_kernel" and summary["hash"] and summary["line_info"]
    prof = load(tmp_path / "run.ncu-rep")
    assert _compare_with_ncu(prof, _ncu_csv(tmp_path / "run.sass.csv")) >= 8
    entry = get_entry(summary["hash"], tmp_path / summary["cache"])
    table = PL.line_table(prof, PL.join_entry(prof, entry))
    assert table["samples"].sum() == prof.totals["samples"] > 0
    kernel = (REPO / "tests" / "fixtures" / "lines_kernel.py").read_text()
    load_line, call_line = _line_of(kernel, "x = tl.load("), _line_of(kernel, "_load_scaled(x_ptr")
    row = table.set_index("line").loc[load_line]
    assert row["via"] == f"lines_kernel.py:{call_line}" and row["inst_executed"] > 0
