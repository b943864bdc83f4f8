"""`workbench report`: papermill runs, offline HTML export, failure reports, the index, bad input.

Also the widgets' static rendering (what a report shows without a kernel).
The study-01 report is made once per session (about 15 s on 2 cores) and shared
with tests/test_browser.py through pytest's base temp directory.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

# The notebook stack (a GPU node running `pytest -m gpu tests/` may not have it): without it this
# module skips, and the rest of the suite still collects.
for _stack in ("nbformat", "papermill", "nbconvert"):
    pytest.importorskip(_stack, reason=f"needs the notebook stack ({_stack} is not importable: make setup)",
                        exc_type=ImportError)

import nbformat  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "notebooks" / "01_isa_hints.ipynb"


def workbench_report(*args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Run `workbench report ARGS` as the CLI does, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "workbench.cli", "report", "--no-progress", *map(str, args)],
                          cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout)


def study_report(tmp_path_factory) -> Path:
    """The report directory of study 01, made once per session with a fresh compile cache."""
    out = tmp_path_factory.getbasetemp() / "study01-report"
    if not (out / "01_isa_hints.report.json").exists():
        env = {**os.environ, "WORKBENCH_ISA_CACHE": str(tmp_path_factory.getbasetemp() / "study01-cache")}
        res = workbench_report(STUDY, "--out", out, env=env)
        (out / "cli.log").write_text(f"rc={res.returncode}\n{res.stdout}\n{res.stderr}")
    return out


class Tags(HTMLParser):
    """Collect start tags with attributes; script/style bodies are not parsed as markup."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def parse_tags(text: str) -> list[tuple[str, dict]]:
    p = Tags()
    p.feed(text)
    return p.tags


def remote_references(text: str) -> list[str]:
    """Every tag attribute that would make the browser fetch something over the network."""
    bad = []
    for tag, attrs in parse_tags(text):
        for key in ("src", "href", "data", "poster"):
            val = (attrs.get(key) or "").strip().lower()
            if tag == "a" and key == "href":
                continue  # a link the reader may follow is not content the page needs
            if val.startswith(("http:", "https:", "//")):
                bad.append(f"<{tag} {key}={attrs.get(key)}>")
    return bad


def code_outputs(nb) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


# ---------------------------------------------------------------------------
# study 01


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = study_report(tmp_path_factory)
    log = (out / "cli.log").read_text() if (out / "cli.log").exists() else ""
    rec = json.loads((out / "01_isa_hints.report.json").read_text())
    return out, rec, log


def test_study01_runs_under_papermill(study):
    out, rec, log = study
    assert log.startswith("rc=0"), log[-3000:]
    assert rec["ok"] and rec["error"] is None, rec
    nb = nbformat.read(str(out / "01_isa_hints.ipynb"), as_version=4)
    errors = [o for o in code_outputs(nb) if o.output_type == "error"]
    assert not errors, [(o.ename, o.evalue) for o in errors]
    assert nb.metadata["papermill"]["exception"] in (None, False)
    # every code cell ran
    assert all(c.execution_count for c in nb.cells if c.cell_type == "code")
    assert rec["duration_s"] < 120, f"study 01 took {rec['duration_s']} s; keep it under ~60 s on a CPU"


def test_study01_shows_both_vendors_before_and_after(study):
    out, _, _ = study
    page = (out / "01_isa_hints.html").read_text()
    for word in ("st.global.b16", "st.global.v4.b32", "STG.E.U16", "STG.E.128",
                 "global_store_short", "global_store_short_d16_hi", "global_store_dwordx4",
                 "st.global.b32", "st.global.v2.b32", "global_store_dword", "global_store_dwordx2"):
        assert word in page, word
    # the conclusion is computed from the data
    assert "The hint widened the global stores on <strong>4 of 4</strong>" in page
    assert "SPT=1 -&gt; 16-bit, SPT=2 -&gt; 32-bit, SPT=4 -&gt; 64-bit, SPT=8 -&gt; 128-bit" in page
    import torch

    if not torch.cuda.is_available():  # nothing measured, no timing table committed: the report says both
        assert "No timing table" in page and "Not measured here" in page
        assert "workbench report notebooks/01_isa_hints.ipynb --measure quick" in page
    # every figure says where its data come from (here: computed, the assembly is cross-compiled)
    assert 'data-source="computed"' in page


def test_study01_html_is_self_contained(study):
    out, _, _ = study
    page = (out / "01_isa_hints.html").read_text()
    assert remote_references(page) == []
    for cdn in ("require.min.js", "require.js\"", "mathjax@", "MathJax.js?config", "embed-amd.js", "mermaid.esm"):
        assert cdn not in page, cdn
    # plotly figures became html renderings with plotly.js inlined exactly once
    assert "application/vnd.plotly.v1+json" not in page
    graphs = [a for t, a in parse_tags(page) if t == "div" and "plotly-graph-div" in (a.get("class") or "")]
    assert len(graphs) >= 2  # the width chart and the sweep explorer's snapshot
    assert page.count("Plotly.newPlot(") >= len(graphs)
    from plotly.offline import get_plotlyjs

    assert page.count(get_plotlyjs()[:200]) == 1
    # the widgets' static snapshots are there, not an empty widget placeholder
    assert 'class="wb-isa"' in page and "wb-sweep" in page
    assert "application/vnd.jupyter.widget-view+json" not in page


def test_study01_report_opens_with_its_findings_and_folds_its_setup(study):
    """The HTML: title, then the findings (the computed conclusions, no code), then the setup cells in
    closed folds; the executed notebook keeps every cell in its order; the run warned nothing about
    the notebook format (cell ids)."""
    out, _, log = study
    page = (out / "01_isa_hints.html").read_text()
    at = [page.index(s) for s in ("Study 01: store widths", '<section class="wb-findings">',
                                  '<details class="wb-setup">', "(a) Stores through a translated pointer")]
    assert at == sorted(at), at
    box = page[at[1]:page.index("</section>", at[1])]
    assert "The hint widened the global stores on <strong>4 of 4</strong>" in box and "What the data says" in box
    assert "conclusions" not in box  # the output only, not the code that wrote it
    folds = re.findall(r'<details class="wb-setup">(.*?)</details>', page, re.S)
    assert [f.count("jp-CodeCell") for f in folds] == [2, 1]  # parameters + imports; the timing's data source
    assert "celltag_parameters" in folds[0] and "celltag_measure" in folds[1]
    executed = nbformat.read(str(out / "01_isa_hints.ipynb"), as_version=4)
    source = nbformat.read(str(STUDY), as_version=4)
    assert [c.id for c in executed.cells] == [c.id for c in source.cells]
    assert not re.search(r"MissingIDField|DuplicateCellId|nbformat\S*Warning", log), log[-2000:]


def test_report_layout_marks_findings_and_folds(tmp_path):
    """Without a kernel: runs of setup cells fold once each (papermill's injected cell joins them), the
    findings box repeats the tagged cells after the title, and the source notebook is left alone."""
    from workbench.report import export_html

    nb = nbformat.v4.new_notebook()
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    finding = code("print(verdict)", metadata={"tags": ["findings"]})
    finding.outputs = [nbformat.v4.new_output("stream", name="stdout", text="VERDICT-42\n"),
                       nbformat.v4.new_output("display_data", data={"text/html": "<div>LABEL-7</div>"},
                                              metadata={"workbench": {"kind": "data", "source": "committed"}}),
                       nbformat.v4.new_output("display_data", data={"application/vnd.plotly.v1+json": {
                           "data": [{"type": "bar", "x": [1], "y": [2]}], "layout": {}}})]
    nb.cells = [md("# Title"), code("a = 1", metadata={"tags": ["parameters", "setup"]}),
                code("a = 2", metadata={"tags": ["injected-parameters"]}), code("import os", metadata={"tags": ["setup"]}),
                md("## Results\nfirst result"), code("x = 3"), code("plan()", metadata={"tags": ["setup"]}),
                md("## What it says"), finding]
    before = json.dumps(nb, sort_keys=True)
    page = export_html(nb, tmp_path / "r.html").read_text()
    assert json.dumps(nb, sort_keys=True) == before
    folds = re.findall(r'<details class="wb-setup"><summary>([^<]*)</summary>(.*?)</details>', page, re.S)
    assert [s.split("(")[1].split(",")[0] for s, _ in folds] == ["3 cells", "1 cell"]
    assert [f.count("jp-CodeCell") for _, f in folds] == [3, 1]
    at = [page.index(s) for s in ('id="Title"', '<section class="wb-findings">', '<details class="wb-setup">',
                                  "first result")]
    assert at == sorted(at), at
    box = page[at[1]:page.index("</section>", at[1])]
    assert "VERDICT-42" in box and "\u201cWhat it says\u201d" in box and "print" not in box
    assert "plotly-graph-div" not in box and page.count("VERDICT-42") == 2
    assert page.count("LABEL-7") == 1  # the figure's data label goes with the figure
    assert page.count('id="cell-id=') == len(set(re.findall(r'id="(cell-id=[^"]+)"', page)))  # ids stay unique


def test_index_lists_reports_with_provenance(study):
    out, rec, _ = study
    index = (out / "index.html").read_text()
    rows = [a for t, a in parse_tags(index) if t == "tr" and "report" in (a.get("class") or "")]
    assert [r["data-name"] for r in rows] == ["01_isa_hints"]
    assert rows[0]["data-status"] == "ok"
    assert 'href="01_isa_hints.html"' in index
    for key in ("python", "torch", "triton", "plotly", "hostname", "gpu", "targets", "spt_values"):
        assert f"<td>{key}</td>" in index, key
    assert rec["versions"]["triton"] in index and rec["machine"]["hostname"] in index
    assert rec["started"] in index
    assert remote_references(index) == []


# ---------------------------------------------------------------------------
# failures, parameters, --all


def _write_nb(path: Path, *sources: str, params: str = "n = 3") -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(params, metadata={"tags": ["parameters"]})]
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def test_failing_cell_gives_error_report_and_nonzero_exit(tmp_path):
    nb = _write_nb(tmp_path / "nb" / "fails.ipynb",
                   "print('BEFORE' + '-MARKER', n)",
                   "import plotly.express as px\npx.bar(x=[1, 2, 3], y=[3, 1, 2])",
                   "raise RuntimeError('deliberate' + ' failure <here>')",
                   "print('AFTER' + '-MARKER')")
    out = tmp_path / "out"
    res = workbench_report(nb, "--out", out)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "FAILED" in res.stderr and "RuntimeError" in res.stderr
    # The command says what failed without a traceback of its own. The notebook's kernel may log one
    # of its own while it shuts down (zmq's event loop: once in a full run), which is not the command's.
    ours = [t for t in res.stderr.split("Traceback (most recent call last):")[1:] if "zmq" not in t[:400]]
    assert not ours, res.stderr[-2000:]
    executed = nbformat.read(str(out / "fails.ipynb"), as_version=4)
    texts = "".join(o.get("text", "") for o in code_outputs(executed) if o.output_type == "stream")
    assert "BEFORE-MARKER 3" in texts and "AFTER-MARKER" not in texts
    assert any(o.output_type == "error" and o.ename == "RuntimeError" for o in code_outputs(executed))
    page = (out / "fails.html").read_text()
    assert "BEFORE-MARKER 3" in page  # outputs up to the error are kept
    assert "AFTER-MARKER" not in page
    assert "deliberate failure &lt;here&gt;" in page  # the error shows, escaped
    assert "plotly-graph-div" in page  # the figure before the error too
    assert remote_references(page) == []
    rec = json.loads((out / "fails.report.json").read_text())
    assert rec["ok"] is False and rec["error"].startswith("RuntimeError: deliberate failure")
    index = (out / "index.html").read_text()
    assert 'data-status="failed"' in index and 'data-name="fails"' in index


def test_all_runs_numbered_notebooks_with_parameters(tmp_path):
    nbs = tmp_path / "notebooks"
    _write_nb(nbs / "01_first.ipynb", "print('first', n * 2)")
    _write_nb(nbs / "02_second.ipynb", "print('second', n * 3)")
    _write_nb(nbs / "scratch.ipynb", "raise SystemExit('not a study: must not run')")
    res = workbench_report("--all", "-p", "n", "7", "--out", "reports", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    recs = sorted((tmp_path / "reports").glob("*.report.json"))
    assert len(recs) == 2
    index = (tmp_path / "reports" / "index.html").read_text()
    names = [a["data-name"] for t, a in parse_tags(index) if t == "tr" and "data-name" in a]
    assert len(names) == 2 and names[0].startswith("01_first-p") and names[1].startswith("02_second-p")
    assert "<b>7</b>" in index  # the overridden parameter, marked
    for rec_path, want in zip(recs, ("first 14", "second 21")):
        rec = json.loads(rec_path.read_text())
        assert rec["params"] == {"n": 7} and rec["overrides"] == ["n"]
        assert want in (tmp_path / rec["html"]).read_text()


def test_bad_paths_exit_2_with_a_message(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "broken.ipynb").write_text("{ not json")
    (tmp_path / "adir.ipynb").mkdir()
    cases = {
        tmp_path / "missing.ipynb": "no such file",
        tmp_path / "notes.txt": "not a notebook",
        tmp_path / "broken.ipynb": "not a readable Jupyter notebook",
        tmp_path / "adir.ipynb": "is a directory",
    }
    for path, words in cases.items():
        res = workbench_report(path, "--out", tmp_path / "out", timeout=60)
        assert res.returncode == 2, (path, res.stderr)
        assert words in res.stderr and str(path) in res.stderr, res.stderr
        assert "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "out").exists()  # nothing ran


def test_usage_errors_exit_2(tmp_path, capsys):
    from workbench import report_command as report

    nb = _write_nb(tmp_path / "ok.ipynb", "print(n)")
    assert report.main([]) == 2
    assert "give one or more NOTEBOOK" in capsys.readouterr().err
    assert report.main([str(nb), "-p", "nope", "1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "unknown parameter(s) nope" in err and "n" in err
    assert report.main([str(nb), "-p", "not-a-name", "1"]) == 2
    assert report.main([str(nb), "--out", str(nb)]) == 2  # --out is a file


def test_parse_value():
    from workbench.report import parse_value

    assert parse_value("3") == 3 and parse_value("0.5") == 0.5 and parse_value("true") is True
    assert parse_value("[sm90, gfx942]") == ["sm90", "gfx942"]
    assert parse_value("sm90") == "sm90" and parse_value("'3'") == "3"


def test_make_offline_converts_plotly_and_widgets():
    from workbench.report import make_offline

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output("display_data", data={"application/vnd.plotly.v1+json": {
            "data": [{"type": "bar", "x": [1, 2], "y": [3, 4]}], "layout": {"height": 300}}}),
        nbformat.v4.new_output("display_data", data={
            "application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2, "version_minor": 0},
            "text/plain": "VBox(...)", "text/html": "<div>snapshot</div>"}),
        nbformat.v4.new_output("display_data", data={
            "application/vnd.jupyter.widget-view+json": {"model_id": "def", "version_major": 2, "version_minor": 0},
            "text/plain": "IntSlider(value=3)"}),
    ]
    nb.cells = [cell]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    assert make_offline(nb) is True
    first, second, third = (o.data for o in nb.cells[0].outputs)
    assert "application/vnd.plotly.v1+json" not in first and "Plotly.newPlot" in first["text/html"]
    assert "height:300px" in first["text/html"].replace(" ", "")
    assert second == {"text/plain": "VBox(...)", "text/html": "<div>snapshot</div>"}
    assert "interactive widget" in third["text/html"] and "text/plain" not in third
    assert "widgets" not in nb.metadata


# ---------------------------------------------------------------------------
# widgets, statically


@pytest.fixture(scope="module")
def hint_pair(tmp_path_factory):
    from kernels.comm import isa_hints as K

    cache = tmp_path_factory.mktemp("widget-cache")
    (a,) = K.compile_remote_store(["sm90"], block=2048, dtype="fp16", hint=False, cache_dir=cache)
    (b,) = K.compile_remote_store(["sm90"], block=2048, dtype="fp16", hint=True, cache_dir=cache)
    return a, b, cache


def _cells_with_class(page: str, cls: str) -> int:
    return sum(1 for t, a in parse_tags(page) if t == "td" and cls in (a.get("class") or "").split())


def test_isa_diff_html_colours_widths_and_escapes(hint_pair):
    from workbench.widgets import isa_diff_html

    a, b, _ = hint_pair
    page = isa_diff_html(a, b, "ptx", context=None)
    assert _cells_with_class(page, "wb-w16") == 16  # st.global.b16 x 16, all on side A
    assert _cells_with_class(page, "wb-w128") >= 2 + 2  # ld.global.v4 on both sides, st.global.v4 on B
    assert "%rs&lt;" in page and "%rs<" not in page  # `.reg .b16 %rs<17>;` is escaped
    mem = isa_diff_html(a, b, "ptx", context="memory")
    assert "st.global.b16" in mem and "st.global.v4.b32" in mem and ".loc" not in mem
    assert "<td>-16</td>" in mem.replace(' style="color:#c62828;font-weight:bold"', "")
    # the opcodes whose count changed, the byte moves of the unhinted store among them
    plain = page.replace(' style="color:#c62828;font-weight:bold"', "").replace(' style="text-align:left"', "")
    assert "opcodes whose count changed" in page and "<td>st</td>" in plain and "<td>mov</td>" in plain


def test_diff_table_escapes_everything():
    from workbench.asm.diff import Row
    from workbench.widgets import diff_table_html

    evil = "<script>alert(1)</script> & <img src=x onerror=alert(2)>"
    page = diff_table_html([Row("replace", 1, evil, 1, "st.global.b16 [%r1], " + evil)], "ptx", context=None)
    assert "<script>" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;img" in page


def test_isa_diff_widget_state_and_static_snapshot(hint_pair):
    from workbench.widgets import IsaDiffWidget

    a, b, cache = hint_pair
    w = IsaDiffWidget({"no hint": a, "hint": b}, a="no hint", b="hint")
    assert w.stage == "ptx" and "sass" in w.pick_stage.options
    bundle = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "st.global.b16" in bundle["text/html"] and "STG.E.U16" not in bundle["text/html"]
    w.pick_stage.value = "sass"
    assert "STG.E.U16" in w.view.value and "STG.E.128" in w.view.value
    assert w.to_html() == w.view.value and "STG.E.128" in w.static().data
    w.pick_a.value = "hint"
    assert "0 changed row(s)" in w.view.value
    # default: every entry of a cache directory
    w2 = IsaDiffWidget(cache_dir=cache)
    assert len(w2.pick_a.options) == 2
    with pytest.raises(ValueError, match="no entry labelled"):
        IsaDiffWidget({"x": a}, a="y")


def test_sweep_explorer_filters_and_static_figure():
    import pandas as pd
    from workbench.widgets import SweepExplorer

    df = pd.DataFrame([dict(target=t, dtype=d, spt=s, gbps=float(s * 100 + len(t)))
                       for t in ("sm90", "gfx942") for d in ("fp16", "fp32") for s in (1, 2, 4, 8)])
    ex = SweepExplorer(df, x="spt", y="gbps", color="target", initial={"dtype": "fp16"})
    assert ex.filters == ["target", "dtype"] and len(ex.filtered()) == 8
    ex.dropdowns["target"].value = "sm90"
    assert len(ex.filtered()) == 4 and ex.selection() == {"target": "sm90", "dtype": "fp16"}
    page = ex._repr_mimebundle_()["text/html"]
    assert "Plotly.newPlot" in page and "<b>4</b> of 16 rows" in page
    assert "gbps vs spt (target=sm90, dtype=fp16)" in ex.figure().layout.title.text
    with pytest.raises(ValueError, match="not in the table"):
        SweepExplorer(df, x="nope", y="gbps")


def test_export_warns_about_outputs_that_fetch(tmp_path, capsys):
    from workbench.report import export_html, remote_references

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        "text/html": '<script src="https://cdn.example.org/lib.js"></script><a href="https://example.org">ok</a>'})]
    nb.cells = [cell]
    page = export_html(nb, tmp_path / "x.html").read_text()
    assert remote_references(page) == ["<script src=https://cdn.example.org/lib.js>"]
    assert "not self-contained" in capsys.readouterr().err
