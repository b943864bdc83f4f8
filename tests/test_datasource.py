"""`workbench.datasource`: where a study notebook's data come from, and what its report says about them.

CPU only. The unit tests patch the GPU count (`datasource._gpu_count`) and measure with tiny fake
scripts; the report tests run `workbench report` on small synthetic notebooks built here (a failing
measurement, a fresh `--measure quick` run, a committed render), and one test per study notebook
executes its `measure`-tagged cells (and the cells before them) with measure=quick and measure=full on
this GPU-less machine: each must show the command a GPU run would use instead of measuring.
"""
from __future__ import annotations

import html
import json
import math
import os
import re
import shlex
import signal
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

# The notebook stack (a GPU node running `pytest -m gpu tests/` may not have it): without it this
# module skips, and the rest of the suite still collects.
for _stack in ("nbformat", "papermill", "nbconvert"):
    pytest.importorskip(_stack, reason=f"needs the notebook stack ({_stack} is not importable: make setup)",
                        exc_type=ImportError)
pytest.importorskip("IPython", reason="needs IPython (the notebook stack: make setup)", exc_type=ImportError)

import nbformat  # noqa: E402
from test_report import REPO, workbench_report  # noqa: E402
from workbench import datasource  # noqa: E402
from workbench.datasource import MeasureError, compare_cases, plan  # noqa: E402

NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}  # a GPU node running these tests measures nothing


@pytest.fixture
def gpus(monkeypatch):
    """Set how many GPUs `plan` sees: ``gpus(n)``."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(datasource, "_gpu_count", lambda: n)
    set_count(0)
    return set_count


@pytest.fixture
def shown(monkeypatch):
    """What datasource displays: a list of (kind, text, metadata) instead of IPython output."""
    out: list[tuple[str, str, dict]] = []
    monkeypatch.setattr(datasource, "_display_note", lambda text, meta: out.append(("note", text, meta)))
    monkeypatch.setattr(datasource, "_display_html", lambda page, meta: out.append(("html", page, meta)))
    import IPython.display

    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: out.append(("display", objs, kw)))
    return out


def _script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


# A measuring script: rows.csv (quick: two cases, else three) into --out.
GOOD_SCRIPT = """
    import argparse, pathlib
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = ["a", "b"] if a.quick else ["a", "b", "c"]
    rows = ["case,ours,baseline,ms"] + [f"{c},1.0,1.1,{i + 1}" for i, c in enumerate(cases)]
    (out / "rows.csv").write_text("\\n".join(rows) + "\\n")
    print("measured", len(cases), "cases; quick =", a.quick, flush=True)
"""

# Fails half-way: some output and a partial table first.
FAILING_SCRIPT = """
    import pathlib, sys
    out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.csv").write_text("case,ours,baseline,ms\\na,1.0,1.1,1\\n")
    for i in range(60):
        print(f"progress line {i}", flush=True)
    print("RuntimeError: CUDA error: an illegal memory access (simulated)", file=sys.stderr, flush=True)
    sys.exit(3)
"""

# Never ends, and has started a child that would not end either.
HANGING_SCRIPT = """
    import pathlib, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    pathlib.Path(sys.argv[1]).write_text(str(child.pid))
    print("started child", child.pid, flush=True)
    time.sleep(300)
"""


def _committed(tmp_path: Path, provenance_columns: bool = True) -> Path:
    d = tmp_path / "committed"
    d.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame({"case": ["a", "b", "c"], "ours": [1.0, 2.0, 4.0], "baseline": [1.1, 2.2, 4.4],
                       "ms": [1.0, 2.0, 4.0]})
    if provenance_columns:
        df = df.assign(prov_device_name="NVIDIA H200", prov_git_sha="0123456789abcdef0123")
    df.to_csv(d / "rows.csv", index=False)
    return d


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has ended (nobody may have reaped it yet)


# ---------------------------------------------------------------------------
# plan(): which mode


@pytest.mark.parametrize("asked, n_gpus, mode", [
    ("auto", 0, "committed"), ("auto", 1, "quick"), ("committed", 0, "committed"), ("committed", 8, "committed"),
    ("quick", 0, "committed"), ("quick", 1, "quick"), ("full", 0, "committed"), ("full", 1, "full"),
    ("QUICK ", 1, "quick"),
])
def test_plan_modes(gpus, tmp_path, asked, n_gpus, mode):
    gpus(n_gpus)
    data = plan("study", asked, committed_dir=tmp_path / "committed", fresh_dir=tmp_path / "fresh")
    assert data.mode == mode and data.gpus == n_gpus
    assert data.fresh == (mode != "committed")
    assert data.quick == (mode == "quick" if data.fresh else asked != "full")  # not measured: the planned run
    if data.fresh:
        assert data.run_dir == tmp_path / "fresh" / "study" and data.dir == data.run_dir
        assert data.out == str(data.run_dir)
        assert f"this machine has {n_gpus} GPU(s)" in data.note
    else:
        assert data.run_dir is None and data.dir == tmp_path / "committed" and data.out == "RUN_DIR"
    if asked.strip() != "committed" and not n_gpus:
        assert "needs 1 CUDA GPU(s)" in data.note and "this machine has 0" in data.note


@pytest.mark.parametrize("value, asked", [(True, "quick"), ("true", "quick"), ("yes", "quick"), (1, "quick"),
                                          (False, "committed"), ("false", "committed"), (None, "committed"),
                                          ("", "committed"), (0, "committed")])
def test_plan_takes_the_old_boolean_parameters(gpus, tmp_path, value, asked):
    gpus(1)
    data = plan("study", value, committed_dir=tmp_path, fresh_dir=tmp_path / "fresh")
    assert data.asked == asked and data.mode == asked


def test_plan_refuses_an_unknown_mode_clearly(tmp_path):
    with pytest.raises(ValueError) as err:
        plan("study", "fast", committed_dir=tmp_path)
    assert "measure='fast'" in str(err.value) and "auto, committed, quick, full" in str(err.value)


@pytest.mark.parametrize("n_gpus, mode", [(0, "committed"), (1, "committed"), (2, "quick"), (4, "quick")])
def test_plan_gpus_needed(gpus, tmp_path, n_gpus, mode):
    gpus(n_gpus)
    data = plan("all_gather", "auto", committed_dir=tmp_path, gpus_needed=2, fresh_dir=tmp_path / "fresh")
    assert data.mode == mode and data.gpus_needed == 2
    if mode == "committed":
        assert "needs 2 CUDA GPU(s)" in data.note and f"this machine has {n_gpus}" in data.note


def test_plan_run_directories(gpus, tmp_path, monkeypatch):
    gpus(1)
    monkeypatch.setenv(datasource.ENV_FRESH_DIR, str(tmp_path / "from-env"))
    first = plan("study", "quick", committed_dir="results/study")
    assert first.run_dir == tmp_path / "from-env" / "study"
    assert first.committed_dir == datasource.REPO_ROOT / "results" / "study"  # relative: under the repo
    first.run_dir.mkdir(parents=True)
    second = plan("study", "quick", committed_dir="results/study")  # never mixes two runs' data
    assert second.run_dir.parent == first.run_dir.parent and re.fullmatch(r"study-\d{8}-\d{6}", second.run_dir.name)
    assert plan("study", "full", committed_dir=tmp_path, fresh_dir=tmp_path / "arg").run_dir == tmp_path / "arg" / "study"


# ---------------------------------------------------------------------------
# measure(): a fresh run with provenance and a log


def test_measure_writes_table_provenance_and_log(gpus, shown, tmp_path):
    gpus(1)
    script = _script(tmp_path, "fake_measure.py", GOOD_SCRIPT)
    data = plan("study", "quick", committed_dir=_committed(tmp_path), fresh_dir=tmp_path / "fresh")
    t0 = time.monotonic()
    got = data.measure([script, "--out", data.out, *(["--quick"] if data.quick else [])], timeout_s=60,
                       world_size=1)
    assert got == data.run_dir and data.measured
    assert time.monotonic() - t0 < 30
    prov = json.loads((data.run_dir / "provenance.json").read_text())
    assert prov["state"] == "ok" and prov["returncode"] == 0 and prov["timed_out"] is False
    assert prov["mode"] == "quick" and prov["study"] == "study" and prov["world_size"] == 1
    assert prov["command"] == f"python {script} --out {data.run_dir} --quick"
    assert prov["git_sha"] and isinstance(prov["duration_s"], (int, float)) and prov["duration_s"] >= 0
    assert prov["timeout_s"] == 60 and prov["started"] and prov["finished"]
    assert "knobs" not in prov and data.provenance == prov
    log = (data.run_dir / "log.txt").read_text()
    assert log.startswith("$ ") and str(script) in log.splitlines()[0]
    assert "measured 2 cases; quick = True" in log
    assert not (data.run_dir / "provenance.json.tmp").exists()
    assert list(data.read("rows.csv").case) == ["a", "b"]  # the fresh table, not the committed one
    assert list(data.read_committed("rows.csv").case) == ["a", "b", "c"]
    assert data.read("missing.csv").empty


def test_measure_failure_raises_with_the_log_tail(gpus, tmp_path):
    gpus(1)
    script = _script(tmp_path, "fake_fails.py", FAILING_SCRIPT)
    data = plan("study", "full", committed_dir=tmp_path, fresh_dir=tmp_path / "fresh")
    with pytest.raises(MeasureError) as err:
        data.measure([script, "--out", data.out], timeout_s=60)
    msg = str(err.value)
    assert "the full run exited with 3" in msg and "log.txt" in msg
    assert "CUDA error: an illegal memory access (simulated)" in msg
    assert "progress line 59" in msg and "progress line 5\n" not in msg  # the tail, not the whole log
    assert len(msg.splitlines()) <= datasource.LOG_TAIL_LINES + 2
    prov = json.loads((data.run_dir / "provenance.json").read_text())
    assert prov["state"] == "failed" and prov["returncode"] == 3 and not data.measured


def test_measure_timeout_kills_the_process_group(gpus, tmp_path):
    gpus(1)
    script = _script(tmp_path, "fake_hangs.py", HANGING_SCRIPT)
    pid_file = tmp_path / "child.pid"
    data = plan("study", "quick", committed_dir=tmp_path, fresh_dir=tmp_path / "fresh")
    t0 = time.monotonic()
    child = None
    try:
        with pytest.raises(MeasureError) as err:
            data.measure([script, pid_file], timeout_s=3)
        took = time.monotonic() - t0
        child = int(pid_file.read_text())
        assert 3 <= took < 15, took
        assert "passed its 3 s timeout and was stopped" in str(err.value)
        assert "started child" in str(err.value)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the measuring script's child outlived the timeout"
        prov = json.loads((data.run_dir / "provenance.json").read_text())
        assert prov["state"] == "failed" and prov["timed_out"] is True
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_measure_timeout_env_caps_the_cell_timeout(gpus, tmp_path, monkeypatch):
    gpus(1)
    script = _script(tmp_path, "fake_hangs.py", HANGING_SCRIPT)
    monkeypatch.setenv(datasource.ENV_TIMEOUT, "2")
    data = plan("study", "quick", committed_dir=tmp_path, fresh_dir=tmp_path / "fresh")
    t0 = time.monotonic()
    child = None
    try:
        with pytest.raises(MeasureError, match="passed its 2 s timeout"):
            data.measure([script, tmp_path / "child.pid"], timeout_s=500)
        child = int((tmp_path / "child.pid").read_text())
        assert time.monotonic() - t0 < 15
        assert json.loads((data.run_dir / "provenance.json").read_text())["timeout_s"] == 2.0
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    monkeypatch.setenv(datasource.ENV_TIMEOUT, "ten minutes")
    again = plan("study", "quick", committed_dir=tmp_path, fresh_dir=tmp_path / "fresh2")
    with pytest.raises(MeasureError, match="is not a number of seconds"):
        again.measure([script, tmp_path / "child2.pid"], timeout_s=5)


@pytest.mark.parametrize("asked, flag", [("quick", True), ("auto", True), ("full", False), ("committed", True)])
def test_committed_mode_shows_the_planned_command(gpus, shown, tmp_path, asked, flag):
    gpus(0)
    data = plan("study", asked, committed_dir=tmp_path, fresh_dir=tmp_path / "fresh")
    quick = data.quick
    assert data.measure(["experiments/run_x.py", "--out", data.out, *(["--quick"] if quick else [])]) is None
    assert not (tmp_path / "fresh").exists()
    [(kind, text, meta)] = shown
    assert kind == "note" and text.startswith("**Not measured here:**") and data.note in text
    assert meta["kind"] == "measure-skipped" and meta["study"] == "study"
    assert meta["mode"] == ("full" if asked == "full" else "quick")
    assert meta["command"].startswith("experiments/run_x.py --out RUN_DIR")
    assert ("--quick" in meta["command"]) == flag
    assert f"`python {meta['command']}`" in text


def test_planned_command_names_repository_paths_relative(gpus, shown, tmp_path):
    gpus(0)
    data = plan("study", "quick", committed_dir=tmp_path, fresh_dir=tmp_path / "fresh")
    data.measure([datasource.REPO_ROOT / "experiments" / "run_x.py", "--out",
                  datasource.REPO_ROOT / "results" / "fresh" / "x", "--from", "/elsewhere/data"])
    assert shown[0][2]["command"] == "experiments/run_x.py --out results/fresh/x --from /elsewhere/data"


# ---------------------------------------------------------------------------
# labels


def test_labels_fresh_committed_and_computed(gpus, shown, tmp_path):
    committed = _committed(tmp_path)
    gpus(0)
    old = plan("study", "auto", committed_dir=committed)
    label = old.label("rows.csv")
    assert label == f"committed data: {committed / 'rows.csv'} (measured on NVIDIA H200, git 0123456789ab)"
    assert old.label() == "computed in this notebook on this machine (no measured data)"
    assert plan("s", "auto", committed_dir=_committed(tmp_path / "x", provenance_columns=False)).label(
        "rows.csv").endswith("rows.csv")  # no provenance columns: the file alone

    gpus(1)
    new = plan("study", "quick", committed_dir=committed, fresh_dir=tmp_path / "fresh")
    new.measure([_script(tmp_path, "m.py", GOOD_SCRIPT), "--out", new.out, "--quick"])
    shown.clear()
    label = new.label("rows.csv")
    assert label.startswith("fresh data (quick run, ") and label.endswith(f": {new.run_dir / 'rows.csv'}")
    assert f"git {new.provenance['git_sha'][:12]}" in label

    old.badge("rows.csv")
    new.badge("rows.csv")
    new.badge()
    kinds = [(m["source"], m["kind"]) for _, _, m in shown]
    assert kinds == [("committed", "data"), ("fresh", "data"), ("computed", "data")]
    page = shown[0][1]
    assert 'class="wb-data wb-data-committed" data-source="committed"' in page and html.escape(old.label("rows.csv")) in page
    assert shown[1][2]["files"] == [str(new.run_dir / "rows.csv")] and shown[1][2]["label"] == label


def test_show_labels_figures_and_tables(gpus, shown, tmp_path, monkeypatch):
    import plotly.graph_objects as go

    shows = []
    monkeypatch.setattr(go.Figure, "show", lambda self, *a, **k: shows.append(self))
    gpus(0)
    data = plan("study", "auto", committed_dir=_committed(tmp_path))
    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]))
    data.show(fig, "rows.csv")
    data.show(go.Figure(), )
    df = data.read("rows.csv")
    data.show(df, "rows.csv")
    assert [a.text for a in shows[0].layout.annotations] == ["committed: rows.csv"]
    assert [a.text for a in shows[1].layout.annotations] == ["computed here"]
    sources = [m["source"] for kind, _, m in shown if kind == "html"]
    assert sources == ["committed", "computed", "committed"]
    assert any(kind == "display" and objs[0] is df for kind, objs, _ in shown)


def test_summary_says_where_the_data_come_from(gpus, shown, tmp_path):
    gpus(0)
    plan("study", "full", committed_dir=tmp_path).summary()
    gpus(1)
    fresh = plan("study", "quick", committed_dir=tmp_path, fresh_dir=tmp_path / "fresh")
    fresh.measure([_script(tmp_path, "m.py", GOOD_SCRIPT), "--out", fresh.out])
    fresh.summary()
    (_, committed_page, cm), (_, fresh_page, fm) = [s for s in shown if s[2].get("kind") == "data-summary"]
    assert cm["source"] == "committed" and "committed results" in committed_page and "needs 1 CUDA" in cm["note"]
    assert fm["source"] == "fresh" and fm["mode"] == "quick" and fm["dir"] == str(fresh.run_dir)
    assert "measured now (quick)" in fresh_page and html.escape(fresh.provenance["command"]) in fresh_page


# ---------------------------------------------------------------------------
# fresh against committed


def _cases(rows):
    return pd.DataFrame(rows, columns=["case", "ours", "baseline"]).set_index("case")


COMMITTED = _cases([(c, 1.0, 1.1) for c in "abcdefg"])


@pytest.mark.parametrize("ours, baseline, reason", [
    (1.01, 1.1, "noise: within ±3%"),
    (1.2, 1.1, "ours: REGRESSION, ours slower than committed while the baseline held"),
    (0.8, 1.1, "ours: faster than committed, baseline unchanged"),
    (1.0, 1.3, "baseline: the library slower than committed, ours unchanged"),
    (1.0, 0.9, "baseline: the library faster than committed, ours unchanged"),
    (1.2, 1.5, "machine: both moved (clocks, power, other load, another GPU or driver); ours +20.0%, baseline +36.4%"),
    (1.025, 1.1 * 0.975, "split: ours +2.5%, baseline -2.5%, each within noise"),
])
def test_compare_cases_reasons(ours, baseline, reason):
    table = compare_cases(_cases([("a", ours, baseline)]), COMMITTED, noise=0.03)
    assert list(table.index) == ["a"]
    row = table.loc["a"]
    assert row.why == reason
    assert row.fresh == pytest.approx(baseline / ours) and row.committed == pytest.approx(1.1)
    assert row.change == pytest.approx(baseline / ours / 1.1 - 1)
    assert row.ours_time_change == pytest.approx(ours - 1) and row.baseline_time_change == pytest.approx(baseline / 1.1 - 1)


def test_compare_cases_geomean_common_cases_only():
    fresh = _cases([("a", 1.0, 1.1), ("b", 1.0, 1.32), ("c", 1.25, 1.1), ("new", 1.0, 5.0), ("nan", float("nan"), 1.0),
                    ("d", 0.0, 1.1)])
    table = compare_cases(fresh, COMMITTED, noise=0.05)
    assert list(table.index) == ["a", "b", "c"]  # in both, with positive times
    gm = table.attrs["geomean"]
    want_f = math.exp((math.log(1.1) + math.log(1.32) + math.log(1.1 / 1.25)) / 3)
    assert gm["fresh"] == pytest.approx(want_f) and gm["committed"] == pytest.approx(1.1)
    assert gm["change"] == pytest.approx(want_f / 1.1 - 1) and gm["noise"] == 0.05
    assert gm["by_reason"] == {"noise": 1, "baseline": 1, "ours": 1}
    assert gm["why"].split(":")[0] in ("noise", "split", "ours", "baseline", "machine")


def test_compare_cases_edges():
    assert compare_cases(_cases([]), COMMITTED).empty
    assert compare_cases(_cases([("zzz", 1.0, 1.0)]), COMMITTED).empty  # nothing in common
    with pytest.raises(ValueError, match="lack column"):
        compare_cases(pd.DataFrame({"ours": [1.0]}, index=["a"]), COMMITTED)


def test_compare_in_a_notebook(gpus, shown, tmp_path):
    cases = lambda t: t.set_index("case")[["ours", "baseline"]]  # noqa: E731
    gpus(0)
    assert plan("study", "auto", committed_dir=_committed(tmp_path)).compare(cases, "rows.csv", what="x") is None
    gpus(1)
    data = plan("study", "quick", committed_dir=_committed(tmp_path), fresh_dir=tmp_path / "fresh")
    data.measure([_script(tmp_path, "m.py", GOOD_SCRIPT), "--out", data.out, "--quick"])
    table = data.compare(cases, "rows.csv", what="speed-up", noise=0.05)
    assert list(table.index) == ["a", "b"]  # the quick grid's cases
    [(_, page, meta)] = [s for s in shown if s[0] == "html" and s[2]["kind"] == "headline"]
    assert meta["what"] == "speed-up" and meta["cases"] == 2 and "speed-up" in page


# ---------------------------------------------------------------------------
# reports of notebooks that measure (synthetic notebooks, `workbench report` as a user runs it)


def _study_notebook(path: Path, script: Path, committed: Path, gpu_node: bool = True) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell('measure = "auto"\nfake_gpus = 0', metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            "from workbench import datasource\n"
            f"if fake_gpus and {gpu_node}:  # this test's stand-in for a GPU node\n"
            "    datasource._gpu_count = lambda: fake_gpus\n"
            "print('BEFORE' + '-MEASURE')", metadata={"tags": []}),
        nbformat.v4.new_code_cell(
            f"data = datasource.plan('synthetic', measure, committed_dir={str(committed)!r}, gpus_needed=1)\n"
            f"data.measure([{str(script)!r}, '--out', data.out, *(['--quick'] if data.quick else [])], timeout_s=60)\n"
            "data.summary()\n"
            "df = data.read('rows.csv')", metadata={"tags": ["measure"]}),
        nbformat.v4.new_code_cell(
            "import plotly.express as px\n"
            "data.show(px.bar(df, x='case', y='ms', title='synthetic timings'), 'rows.csv')"),
        nbformat.v4.new_code_cell("data.badge('rows.csv')\ndf"),
        nbformat.v4.new_code_cell(
            "data.compare(lambda t: t.set_index('case')[['ours', 'baseline']], 'rows.csv', what='synthetic speed-up',"
            " noise=0.05)"),
        nbformat.v4.new_code_cell("data.show(px.line(x=[1, 2], y=[2, 1]))\nprint('AFTER' + '-MARKER')"),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """One `workbench report --measure quick` of three studies: two on a stand-in GPU node (one measures,
    one fails mid-measurement) and one that sees this machine's (no) GPUs and renders its committed table."""
    tmp = tmp_path_factory.mktemp("synthetic")
    committed = _committed(tmp)
    script = _script(tmp, "measure.py", GOOD_SCRIPT)
    good = _study_notebook(tmp / "nb" / "01_measures.ipynb", script, committed)
    bad = _study_notebook(tmp / "nb" / "02_fails.ipynb", _script(tmp, "fails.py", FAILING_SCRIPT), committed)
    cpu = _study_notebook(tmp / "nb" / "03_on_cpu.ipynb", script, committed, gpu_node=False)
    env = {**os.environ, **NO_GPU_ENV}
    env.pop(datasource.ENV_FRESH_DIR, None)
    res = workbench_report(good, bad, cpu, "--measure", "quick", "-p", "fake_gpus", "1", "--out", tmp / "out",
                           env=env)
    return {"out": tmp / "out", "res": res}


def _record(out: Path, stem: str) -> dict:
    [path] = out.glob(f"{stem}*.report.json")
    return json.loads(path.read_text())


def test_failing_measurement_reports_up_to_the_error(synthetic):
    res, out = synthetic["res"], synthetic["out"]
    assert res.returncode == 1, res.stderr[-3000:]
    assert "2 ok, 1 failed" in res.stderr and "MeasureError" in res.stderr
    rec = _record(out, "02_fails")
    assert rec["ok"] is False and rec["error"].startswith("MeasureError: synthetic: the quick run exited with 3")
    page = Path(rec["html"]).read_text()
    assert "BEFORE-MEASURE" in page and "AFTER-MARKER" not in page
    assert "an illegal memory access (simulated)" in page  # the log's tail, in the error
    assert "plotly-graph-div" not in page  # nothing after the failing cell ran
    [run] = _fresh_dirs(out, "fails")
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["state"] == "failed" and prov["returncode"] == 3
    index = (out / "index.html").read_text()
    assert re.search(r'<tr class="report failed-row" data-status="failed" data-name="02_fails-p\w+"', index)
    assert re.search(r'data-status="ok" data-name="01_measures-p\w+"', index)
    assert re.search(r'data-status="ok" data-name="03_on_cpu-p\w+"', index)
    summary = (out / "summary.md").read_text()
    [line] = [ln for ln in summary.splitlines() if ln.startswith("| 02_fails")]
    assert "FAILED: MeasureError" in line


def _fresh_dirs(out: Path, which: str) -> list[Path]:
    """Fresh run directories under <out>/fresh whose log ran the `which` script."""
    return [d for d in sorted((out / "fresh").iterdir())
            if (d / "log.txt").is_file() and f"{which}.py" in (d / "log.txt").read_text().splitlines()[0]]


def test_measure_quick_gives_fresh_labelled_report(synthetic):
    out = synthetic["out"]
    rec = _record(out, "01_measures")
    assert rec["ok"] is True, rec["error"]
    assert rec["params"]["measure"] == "quick" and "measure" in rec["overrides"]
    data = rec["data"]
    assert data["source"] == "fresh" and data["mode"] == "quick"
    assert data["labels"] == {"fresh": 2, "computed": 1} and data["skipped"] == []
    assert [h["what"] for h in data["headlines"]] == ["synthetic speed-up"] and data["headlines"][0]["cases"] == 2
    [run] = _fresh_dirs(out, "measure")
    assert run.parent == out / "fresh"  # `workbench report` puts fresh data beside the reports
    assert json.loads((run / "provenance.json").read_text())["state"] == "ok"
    page = Path(rec["html"]).read_text()
    assert "fresh data (quick run, " in page and html.escape(str(run / "rows.csv")) in page
    assert '<div class="wb-data-line" data-source="fresh"><b>data:</b> fresh (quick)' in page
    assert "AFTER-MARKER" in page
    summary = (out / "summary.md").read_text()
    [line] = [ln for ln in summary.splitlines() if ln.startswith("| 01_measures")]
    assert "| ok |" in line and "fresh (quick)" in line and "synthetic speed-up" in line


def test_cpu_report_renders_committed_with_the_planned_command(synthetic):
    """A study asked to measure on a machine without its GPUs: a visible note with the command, committed data."""
    out = synthetic["out"]
    rec = _record(out, "03_on_cpu")
    assert rec["ok"] is True, rec["error"]
    data = rec["data"]
    assert data["source"] == "committed" and data["labels"] == {"committed": 2, "computed": 1}
    [cmd] = data["skipped"]
    assert cmd.endswith("measure.py --out RUN_DIR --quick")
    page = Path(rec["html"]).read_text()
    assert "Not measured here:" in page and "committed data: " in page
    assert "measured on NVIDIA H200, git 0123456789ab" in page
    assert "synthetic speed-up: committed numbers only" in page
    assert len(list((out / "fresh").iterdir())) == 2  # the two stand-in GPU runs only


@pytest.mark.browser
@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_reports_show_their_data_in_chromium(synthetic, tmp_path):
    from test_browser import chromium

    def dom(report: Path) -> str:
        res = chromium(report.as_uri(), "--virtual-time-budget=20000", "--run-all-compositor-stages-before-draw",
                       "--dump-dom", user_data=tmp_path / f"profile-{report.parent.name}")
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout

    def texts(page: str, pattern: str) -> list[str]:
        return [html.unescape(re.sub(r"<[^>]+>", "", t)).strip() for t in re.findall(pattern, page, flags=re.S)]

    fresh = dom(Path(_record(synthetic["out"], "01_measures")["html"]))
    committed = dom(Path(_record(synthetic["out"], "03_on_cpu")["html"]))
    # the banner's data line
    [line] = texts(fresh, r'<div class="wb-data-line" data-source="fresh">(.*?)</div>')
    assert line.startswith("data: fresh (quick) from ") and "labelled outputs: 1 computed, 2 fresh" in line
    [line] = texts(committed, r'<div class="wb-data-line" data-source="committed">(.*?)</div>')
    assert line.startswith("data: committed from ") and "committed" in line
    # the labels above the figure and the table, and the figures' own annotations (drawn by plotly.js)
    labels = texts(fresh, r'<div class="wb-data wb-data-fresh" data-source="fresh">(.*?)</div>')
    assert len(labels) == 2 and all(t.startswith("fresh data (quick run, ") and t.endswith("rows.csv") for t in labels)
    labels = texts(committed, r'<div class="wb-data wb-data-committed" data-source="committed">(.*?)</div>')
    assert len(labels) == 2 and all(t.startswith("committed data: ") and "rows.csv (measured on NVIDIA H200" in t
                                    for t in labels)
    assert "fresh: rows.csv" in texts(fresh, r'<text class="annotation-text"[^>]*>(.*?)</text>')
    assert "committed: rows.csv" in texts(committed, r'<text class="annotation-text"[^>]*>(.*?)</text>')
    assert "computed here" in texts(fresh, r'<text class="annotation-text"[^>]*>(.*?)</text>')


# ---------------------------------------------------------------------------
# the real study notebooks: quick/full reach every measuring cell, and a CPU shows the planned command

STUDIES = sorted((REPO / "notebooks").glob("[0-9]*.ipynb"))


def _tags(cell) -> list[str]:
    return list((cell.get("metadata") or {}).get("tags") or [])


def _two_pass_copy(nb):
    """The notebook's cells up to its last `measure` cell, with measure as papermill injects it; then
    `measure = "full"` and once more the cells that plan (`datasource.plan(`) or measure: one kernel for both
    modes, the cells in between run once. Each code cell is marked with its pass."""
    last = max(i for i, c in enumerate(nb.cells) if "measure" in _tags(c))
    head = [c for c in nb.cells[: last + 1]]
    again = [c for c in head if c.cell_type == "code" and "parameters" not in _tags(c)
             and ("measure" in _tags(c) or "datasource.plan(" in c.source)]
    cells = []
    for pass_, part in (("quick", head), ("full", again)):
        if pass_ == "full":
            cells.append(nbformat.v4.new_code_cell('measure = "full"'))
        for c in part:
            c = nbformat.from_dict(json.loads(json.dumps(c)))
            c["id"] = f"{pass_}-{len(cells)}"
            c.metadata["wb_pass"] = pass_
            cells.append(c)
    out = nbformat.v4.new_notebook(metadata=nb.metadata)
    out.cells = cells
    return out


@pytest.mark.parametrize("study", STUDIES, ids=[p.stem for p in STUDIES])
def test_study_measure_cells_get_quick_and_full(study, tmp_path, monkeypatch, tmp_path_factory):
    import papermill as pm

    nb = nbformat.read(str(study), as_version=4)
    n_measure = sum(1 for c in nb.cells if c.cell_type == "code" and "measure" in _tags(c))
    if not n_measure:
        pytest.skip(f"{study.name}: no code cell tagged `measure` yet (not converted to workbench.datasource)")
    params = pm.inspect_notebook(str(study))
    assert "measure" in params, f"{study.name}: its parameters cell has no `measure`"
    copy = tmp_path / study.name
    nbformat.write(_two_pass_copy(nb), str(copy))
    for k, v in NO_GPU_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WORKBENCH_ISA_CACHE", str(tmp_path_factory.getbasetemp() / "study01-cache"))
    monkeypatch.setenv(datasource.ENV_FRESH_DIR, str(tmp_path / "fresh"))
    executed = tmp_path / f"executed-{study.name}"
    pm.execute_notebook(str(copy), str(executed), parameters={"measure": "quick"}, kernel_name="python3",
                        progress_bar=False, log_output=False, cwd=str(study.parent))
    ran = nbformat.read(str(executed), as_version=4)
    commands: dict[str, list[str]] = {"quick": [], "full": []}
    for cell in ran.cells:
        if cell.cell_type != "code" or "measure" not in _tags(cell):
            continue
        pass_ = cell.metadata["wb_pass"]
        skipped = [(o.get("metadata") or {}).get(datasource.META_KEY) for o in cell.get("outputs", [])]
        skipped = [m for m in skipped if isinstance(m, dict) and m.get("kind") == "measure-skipped"]
        assert skipped, f"{study.name} ({pass_}): a `measure` cell showed no measure-skipped note on this CPU"
        for meta in skipped:
            assert meta["mode"] == pass_, (pass_, meta)
            commands[pass_].append(str(meta["command"]))
    assert len(commands["quick"]) >= n_measure and len(commands["full"]) == len(commands["quick"])
    for quick, full in zip(commands["quick"], commands["full"]):
        assert any("quick" in t for t in shlex.split(quick)), f"{study.name}: the quick command has no quick flag: {quick}"
        assert not any("quick" in t for t in shlex.split(full)), f"{study.name}: the full command is quick: {full}"
    assert not (tmp_path / "fresh").exists()  # nothing measured on a CPU


# Every study notebook: one `parameters` cell with measure = "auto", one `measure` cell that plans
# through workbench.datasource (and runs its study's script), figures shown only through data.show,
# a fresh-vs-committed comparison, outputs cleared.
STUDIES = [("01_isa_hints", "isa_hints", None), ("02_gemm_tiling", "gemm_tiling", "run_gemm_tiling.py"),
           ("03_all_gather", "all_gather", "run_all_gather.py"),
           ("04_grouped_gemm", "grouped_gemm", "run_grouped_gemm.py"),
           ("05_all_gather_gemm", "ag_gemm", "run_ag_gemm.py"),
           ("06_gemm_all_scatter", "gemm_scatter", "run_gemm_scatter.py"), ("07_moe_mxfp4", "moe_mxfp4", "run_moe_mxfp4.py")]


@pytest.mark.parametrize("name,study,script", STUDIES, ids=[s[0] for s in STUDIES])
def test_study_notebook_measures_through_datasource(name, study, script):
    import nbformat

    nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    tagged = lambda tag: [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    params, measure = tagged("parameters"), tagged("measure")
    assert len(params) == 1 and 'measure = "auto"' in params[0].source
    assert not re.search(r"^(run_gpu|time_on_gpu)\b", params[0].source, re.M)  # the old switches are gone
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert len(measure) == 1 and f'datasource.plan("{study}"' in code and "data." in measure[0].source
    if script:
        assert script in measure[0].source
    assert ".show()" not in code and "data.compare(" in code
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")

