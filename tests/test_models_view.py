"""workbench.models_view and notebook 07's section "KIMI-K2.5, gpt-oss-120b and gpt-oss-20b side by side".

The module: each model's rows (several files per model, the first winning), the models without rows
named with the reason, bad files refused with the file named. The section: rendered headless with
papermill on CPU from a results folder with all three models' rows, with KIMI-K2.5's only (the
other two say "not measured yet" with the command) and with none.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from workbench import models_view as mv

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ["prepacked default", "prepacked L3", "default"]
COMMAND = "python3 experiments/run_moe_mxfp4.py --out results/moe_mxfp4"


def _rows(path: Path, model: str, ms, seed: int, names=VARIANTS) -> pd.DataFrame:
    """Rows shaped like run_moe_mxfp4.py's, fractions drawn at random (none 0 or 1)."""
    import random

    rnd = random.Random(seed)
    rows = [dict(M=M, name=n, method=meth, kind="ours", frac_hbm_bound=round(rnd.uniform(0.2, 0.9), 4),
                 median_us=rnd.uniform(10, 500), hbm_bound_us=rnd.uniform(5, 200), prov_device_name="NVIDIA H200",
                 prov_git_sha=f"{seed:07x}", prov_timestamp="2026-11-29T00:00:00+00:00",
                 prov_command=f"python3 experiments/run_moe_mxfp4.py --out x  # {model}")
            for M in ms for n in names for meth in ("graph", "eager")]
    rows += [dict(M=ms[0], name="bf16 grouped_mm", method="graph", kind="baseline", frac_hbm_bound=0.3)]
    df = pd.DataFrame(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    return df


def test_load_merges_files_and_names_the_missing(tmp_path):
    main = _rows(tmp_path / "rows.csv", "kimi", (4, 32), 1, names=["default"])
    older = _rows(tmp_path / "old" / "rows.csv", "kimi", (4, 8), 2, names=["default", "prepacked default"])
    (tmp_path / "empty").mkdir()
    pd.DataFrame({"M": [4], "name": ["bf16 grouped_mm"], "method": ["graph"], "frac_hbm_bound": [0.4]}).to_csv(
        tmp_path / "empty" / "rows.csv", index=False)
    got = mv.load({"A": [tmp_path / "rows.csv", tmp_path / "old" / "rows.csv"], "B": tmp_path / "nope" / "rows.csv",
                   "C": tmp_path / "empty" / "rows.csv"}, VARIANTS)
    assert got.models == ["A"] and set(got.missing) == {"B", "C"}
    assert "no rows.csv under" in got.missing["B"] and "no rows of prepacked default" in got.missing["C"]
    rel = mv.load({"B": tmp_path / "nope" / "rows.csv"}, VARIANTS, root=tmp_path).missing["B"]
    assert rel == "no rows.csv under nope"                                          # what a report shows
    a = got.rows.set_index(["variant", "method", "M"]).frac_hbm_bound
    want = lambda df, n, meth, M: df[(df.name == n) & (df.method == meth) & (df.M == M)].frac_hbm_bound.item()
    assert a[("default", "graph", 4)] == want(main, "default", "graph", 4)          # the first file wins
    assert a[("default", "eager", 8)] == want(older, "default", "eager", 8)         # the later one fills in
    assert a[("prepacked default", "graph", 8)] == want(older, "prepacked default", "graph", 8)
    assert list(got.rows.variant.unique()) == ["prepacked default", "default"]      # the order given
    assert len(got.rows) == 2 * 3 + 2 * 2 and "bf16 grouped_mm" not in set(got.rows.variant)
    src = mv.sources(got, tmp_path)
    assert list(src.file) == ["rows.csv", "old/rows.csv"] and list(src.rows) == [4, 6]
    assert src.git.tolist() == ["0000001", "0000002"]
    note = mv.missing_note(got, COMMAND)
    assert "**B: not measured yet**" in note and "**C: not measured yet**" in note and COMMAND in note
    fig = mv.figure(got, goal=0.75)
    assert {t.name for t in fig.data} == {"A, prepacked default", "A, default"}
    assert mv.figure(mv.load({"B": tmp_path / "nope.csv"}, VARIANTS)) is None
    assert mv.missing_note(mv.load({"A": tmp_path / "rows.csv"}, VARIANTS), COMMAND) == ""


def test_load_refuses_bad_files(tmp_path, monkeypatch):
    bad = tmp_path / "rows.csv"
    bad.write_text("M,name,method\n4,default,graph\n")
    with pytest.raises(ValueError, match=r"rows.csv: no column\(s\) frac_hbm_bound"):
        mv.load({"A": bad}, VARIANTS)
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="not a readable CSV"):
        mv.load({"A": bad}, VARIANTS)
    _rows(bad, "a", (4,), 3)
    monkeypatch.setattr(mv, "MAX_BYTES", 100)
    with pytest.raises(ValueError, match=r"bytes, over the 100 this view reads"):
        mv.load({"A": bad}, VARIANTS)


# ---------------------------------------------------------------------------------------------
# notebook 07's section, rendered headless


def _section_notebook(path: Path):
    """Notebook 07's parameters, setup and measure cells, then the section's cells."""
    import nbformat

    nb = nbformat.read(str(REPO / "notebooks" / "07_moe_mxfp4.ipynb"), as_version=4)
    tags = lambda c: (c.get("metadata") or {}).get("tags") or []
    head = [c for c in nb.cells if {"parameters", "setup", "measure"} & set(tags(c))]
    i = next(i for i, c in enumerate(nb.cells) if "models" in tags(c))
    out = nbformat.v4.new_notebook(metadata=nb.metadata)
    out.cells = head + [nb.cells[i - 1], nb.cells[i]]
    nbformat.write(out, str(path))
    return nb.cells[i].source


def _results(tmp_path: Path, models) -> Path:
    d = tmp_path / "results"
    d.mkdir()
    ms = {"KIMI-K2.5": (4, 8, 256), "gpt-oss-120b": (1, 48, 256), "gpt-oss-20b": (1, 3, 48)}
    sub = {"KIMI-K2.5": "", "gpt-oss-120b": "gpt-oss-120b", "gpt-oss-20b": "gpt-oss-20b"}
    for i, m in enumerate(models):
        _rows(d / sub[m] / "rows.csv", m, ms[m], 10 + i)
    if "KIMI-K2.5" in models:
        (d / "info.json").write_text(json.dumps({"copy_gbps": 4223.0}))
        pd.DataFrame(columns=["name", "form", "ok", "worst_err_over_bound"]).to_csv(d / "checks.csv", index=False)
    return d


def _run_section(tmp_path, models):
    pytest.importorskip("papermill", exc_type=ImportError)
    import nbformat
    import papermill as pm

    tmp_path.mkdir(parents=True, exist_ok=True)
    src = _section_notebook(tmp_path / "section.ipynb")
    results = _results(tmp_path, models)
    pm.execute_notebook(str(tmp_path / "section.ipynb"), str(tmp_path / "ran.ipynb"), kernel_name="python3",
                        parameters={"results_dir": str(results), "measure": "committed", "show_asm": False,
                                    "interpreter_demo": False},
                        progress_bar=False, log_output=False, cwd=str(REPO / "notebooks"))
    ran = nbformat.read(str(tmp_path / "ran.ipynb"), as_version=4)
    cell = next(c for c in ran.cells if c.cell_type == "code" and c.source == src)
    assert not [o for o in cell.outputs if o.output_type == "error"]
    figs = [o.data["application/vnd.plotly.v1+json"] for o in cell.outputs
            if "application/vnd.plotly.v1+json" in o.get("data", {})]
    text = "\n".join(str(o.get("data", {}).get(kind, "")) for o in cell.outputs
                     for kind in ("text/markdown", "text/html"))
    return figs, text


def test_section_renders_with_every_model(tmp_path):
    figs, text = _run_section(tmp_path, ["KIMI-K2.5", "gpt-oss-120b", "gpt-oss-20b"])
    assert len(figs) == 1
    names = {t["name"].split(",")[0] for t in figs[0]["data"]}
    assert names == {"KIMI-K2.5", "gpt-oss-120b", "gpt-oss-20b"}
    assert {t["name"].split(", ")[1] for t in figs[0]["data"]} == set(VARIANTS)
    assert "not measured yet" not in text and "gpt-oss-20b/rows.csv" in text


def test_section_says_what_is_not_measured(tmp_path):
    figs, text = _run_section(tmp_path, ["KIMI-K2.5"])
    assert len(figs) == 1 and {t["name"].split(",")[0] for t in figs[0]["data"]} == {"KIMI-K2.5"}
    for m in ("gpt-oss-120b", "gpt-oss-20b"):
        assert f"**{m}: not measured yet**" in text
    assert "python3 experiments/run_moe_mxfp4.py --out" in text
    figs, text = _run_section(tmp_path / "none", [])
    assert not figs and text.count("not measured yet") == 3


def test_notebook_models_are_the_scripts():
    """The section's gpt-oss folders are run_moe_mxfp4.py's model names (where it writes their rows)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_moe_mxfp4", REPO / "experiments" / "run_moe_mxfp4.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    src = next(c for c in json.loads((REPO / "notebooks" / "07_moe_mxfp4.ipynb").read_text())["cells"]
               if "models" in c.get("metadata", {}).get("tags", []))
    for name in run.MODELS:
        if name != run.KIMI:
            assert f'"{name}/rows.csv"' in "".join(src["source"]), name
