"""experiments/run_overlap.py: the one command per 2-GPU node (its CPU part: the steps it runs,
their limits, the summary it writes from the tables; a machine without 2 GPUs is refused)."""
import importlib.util
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("run_overlap", REPO / "experiments" / "run_overlap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_steps_are_the_tests_then_both_benchmarks_within_eight_minutes(tmp_path):
    r = _script()
    names = [s[0] for s in r.steps(tmp_path)]
    assert names == ["pytest", "ag_gemm", "gemm_scatter"]
    cmds = {name: cmd for name, cmd, _, _ in r.steps(tmp_path)}
    assert cmds["pytest"][-3:] == list(r.TEST_FILES) and "multigpu" in cmds["pytest"]
    for name in ("ag_gemm", "gemm_scatter"):
        assert cmds[name][cmds[name].index("--shape-set") + 1] == "llm-reduced"
        assert cmds[name][cmds[name].index("--world-sizes") + 1] == "2"
        assert cmds[name][cmds[name].index("--out") + 1] == str(tmp_path / name)
        budget, limit = r.LIMITS[name]
        assert float(cmds[name][cmds[name].index("--budget-s") + 1]) == budget < limit
    # the steps' budgets (what starts new work) stay within 8 minutes; their kill limits bound a hang
    assert r.LIMITS["pytest"][1] // 2 + r.LIMITS["ag_gemm"][0] + r.LIMITS["gemm_scatter"][0] <= 8 * 60


def test_summary_reads_the_tables(tmp_path):
    r = _script()
    (tmp_path / "ag_gemm").mkdir()
    (tmp_path / "gemm_scatter").mkdir()
    (tmp_path / "pytest_multigpu.txt").write_text("....\n5 passed, 200 deselected in 140.0s\n")
    held = pd.DataFrame([dict(world_size=2, gather_dim=gd, M=m, N=5120, K=8192, timing=t, chosen="pipelined",
                              chosen_ms=1.0, regret=1.02, speedup_vs_best_library=sp, gemm_alone_ms=0.9,
                              collective_alone_ms=0.3, comm_hidden_chosen=0.66)
                         for gd in (0, 1) for t in ("eager", "graph") for m, sp in ((1000, 1.1), (4096, 0.95))])
    held.to_csv(tmp_path / "ag_gemm" / "held_out.csv", index=False)
    held.drop(columns="gather_dim").to_csv(tmp_path / "gemm_scatter" / "held_out_w2.csv", index=False)
    pd.DataFrame([dict(M=m, timing="graph", fused_vs_max_alone=v, senders_vs_max_alone=v - 0.1)
                  for m, v in ((64, 3.0), (256, 1.5), (4096, 1.2))]).to_csv(
        tmp_path / "gemm_scatter" / "summary_w2.csv", index=False)
    lines = r.summarize(tmp_path, {"pytest": (0, 140.0), "ag_gemm": (0, 170.0), "gemm_scatter": (1, 95.0)})
    text = "\n".join(lines)
    assert "- pytest: ok in 140 s" in text and "gemm_scatter: FAILED (exit 1)" in text
    assert "5 passed, 200 deselected" in text
    assert text.count("all_gather_matmul world_size=2 gather_dim=") == 4 and "least 0.95x, 1 at >= 1.0x" in text
    assert "gemm_all_scatter graph, M >= 256: the better fused variant at 1.10x-1.40x" in text
    assert "1 of 2 shapes within 1.2x" in text


def test_a_machine_without_two_gpus_is_refused(tmp_path, capsys, monkeypatch):
    import torch

    r = _script()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert r.main(["--out", str(tmp_path / "x")]) == 2
    assert "needs a node with 2 CUDA GPUs" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_the_choice_minimizes_its_worse_regret_over_both_modes():
    """fit_choices: per fit case the method whose worse of (eager, graph) regret is least, never a
    method outside tolerance there; 'eager' alone picks the eager winner."""
    import sys

    sys.path.insert(0, str(REPO / "experiments"))
    import overlap

    times = {  # method: (eager ms, graph ms)
        "fast_eager": (1.00, 2.00),   # the eager winner, twice the best graph time
        "steady": (1.10, 1.05),       # 10% off in eager, 5% in graph: the least worse regret
        "fast_graph": (1.60, 1.00),
        "inaccurate": (0.50, 0.50),   # fastest in both, but outside the tolerance
    }
    rows = [dict(split="fit", status="ok", rank=0, world_size=2, M=4096, N=4096, K=4096, timing=mode,
                 variant=m, ms=t[i], within_tolerance=m != "inaccurate")
            for m, t in times.items() for i, mode in enumerate(("eager", "graph"))]
    bench = pd.DataFrame(rows)
    keys = ["world_size", "M", "N", "K"]
    both = overlap.fit_choices(bench, keys, tuple(times), {})
    assert [(e["method"], e["ms"]) for e in both] == [("steady", 1.10)]
    assert [e["method"] for e in overlap.fit_choices(bench, keys, tuple(times), {}, timing="eager")] == ["fast_eager"]
    assert overlap.fit_choices(bench[bench["timing"] == "eager"], keys, tuple(times), {}) == []  # both modes needed


@pytest.mark.parametrize("world", [2, 4])
def test_refit_of_the_committed_runs_remakes_their_tables(tmp_path, world, capsys):
    """--refit on a copy of a committed run (results/overlap/h200_wW): the shared driver
    (experiments/overlap.py) fits and scores the choice again into the same bytes (auto_table.json,
    held_out*.csv, variant_choice*.csv, the tuning tables, the choice model and its scores) and the
    same summary.md, whose tests'
    line stays although their log is not kept (and is derived again, once, when it is there)."""
    import shutil

    r = _script()
    committed = REPO / "results" / "overlap" / f"h200_w{world}"
    out = tmp_path / committed.name
    shutil.copytree(committed, out)
    made_by_refit = {p.relative_to(out) for p in out.rglob("*") if p.suffix in (".csv", ".json") and (
        p.name.startswith(("auto_table", "held_out", "variant_choice", "choice_model", "choice_scores"))
        or p.parent.name == "nvidia-h200")}
    assert len(made_by_refit) == 14   # per family: 5 files and the tuning table and choice model for the GPU
    for p in made_by_refit:
        (out / p).write_bytes(b"")   # what the refit writes must come from the refit, not from the copy
    # (a run refitted with --fit-random says so in its summary)
    how = ["--fit-random"] if "shapes drawn at run time)" in (committed / "summary.md").read_text() else []
    assert r.main(["--refit", "--world-size", str(world), "--out", str(out)] + how) == 0
    differ = [str(p) for p in made_by_refit if (out / p).read_bytes() != (committed / p).read_bytes()]
    assert not differ, differ
    want = (committed / "summary.md").read_text().splitlines()[1:]
    assert (out / "summary.md").read_text().splitlines()[1:] == want
    tests = [x for x in want if x.startswith("- tests: ")]
    (out / "pytest_multigpu.txt").write_text("....\n3 passed in 100.0s\n")
    assert r.main(["--refit", "--world-size", str(world), "--out", str(out)] + how) == 0
    again = (out / "summary.md").read_text()
    assert again.count("- tests: ") == 1 and "3 passed in 100.0s" in again and all(t not in again for t in tests)
    capsys.readouterr()


def test_a_model_is_scored_on_a_later_runs_shapes(tmp_path):
    """score_choice_model.py: the model fitted on the first 2-rank run (fit half and its drawn
    shapes) replayed on the second run's held-out half and fresh shapes, none of them fitted, beside
    the launcher's measured pick there; the committed scores are what it writes."""
    import shutil
    import sys

    sys.path.insert(0, str(REPO / "experiments"))
    import score_choice_model

    fresh = REPO / "results" / "overlap" / "h200_w2_fresh"
    out = tmp_path / fresh.name
    shutil.copytree(fresh, out)
    model_run = REPO / "results" / "overlap" / "h200_w2"
    fitted = set(pd.read_parquet(model_run / "ag_gemm" / "bench.parquet", columns=["M", "N", "K"])
                 .itertuples(index=False, name=None))
    scored = pd.read_parquet(out / "ag_gemm" / "bench.parquet")
    unseen = scored[scored["split"].isin(["held_out", "random"])]
    drawn = set(unseen[unseen["split"] == "random"][["M", "N", "K"]].itertuples(index=False, name=None))
    assert drawn and not drawn & fitted   # the later run's drawn shapes: none fitted
    lines = score_choice_model.score(out, model_run, 2)
    assert sum("the model of" in x for x in lines) == 12 and sum("as the launcher chose" in x for x in lines) == 12
    for sub in ("ag_gemm", "gemm_scatter"):
        got = pd.read_csv(out / sub / "choice_scores_model.csv")
        assert set(got["rule"]) == {"model", "measured"}
        pd.testing.assert_frame_equal(got, pd.read_csv(fresh / sub / "choice_scores_model.csv"))
