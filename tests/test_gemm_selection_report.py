"""The GEMM selection report's tables on synthetic timings (CPU): experiments/gemm_selection_report.py
(regret against the per-shape best of ours and cuBLAS, as chosen beside ours alone, per set, mode
and region class, the goals of issue 43, host time per path) and experiments/run_gemm_selection.py
writing them from its rows (fresh shapes from a printed seed, the report again from a cut run)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import gemm_selection_report as rep  # noqa: E402
import run_gemm_selection as rgs  # noqa: E402


def _rows(shape: dict, times: dict, chosen: str, cold: str = "t128x256", modes=("graph", "eager"),
          status: dict | None = None, source: str = "table") -> list[dict]:
    """verify.csv + candidates.csv rows of one shape: ``times`` {method: us} (methods ours, cold,
    cublas, ours:<name>); ``chosen``: the candidate matmul ran; eager 10% slower than graph."""
    out = []
    for mode in modes:
        for method, us in times.items():
            cand = {"ours": chosen, "cold": cold, "cublas": "cublas"}.get(method, method[5:])
            out.append(dict(shape, mode=mode, method=method, candidate=cand, source=source if method == "ours" else "",
                            status=(status or {}).get(method, "ok"),
                            median_us=us * (1.1 if mode == "eager" else 1.0)))
    return out


def _shape(M, N, K, set_="held_out", cls="other", dtype="bfloat16", b="row"):
    return {"set": set_, "M": M, "N": N, "K": K, "dtype": dtype, "b": b, "class": cls,
            "split": "fresh-20261129" if set_ == "fresh" else set_}


def _frame(*parts):
    df = pd.DataFrame([r for p in parts for r in p])
    df["method"] = df.method.replace({"ours": "chosen"})
    return df


def test_regret_is_against_the_best_of_ours_and_cublas_and_ours_alone_is_beside_it():
    # cuBLAS ran (the table chose it) where our best candidate is 1.25x faster: regret 0.8;
    # ours alone at 1.25x cuBLAS. A failed candidate (faster, but wrong) does not count.
    rows = _frame(_rows(_shape(4755, 13280, 11560), {"ours": 100.0, "cold": 90.0, "cublas": 100.0,
                                                       "ours:t128x256": 80.0, "ours:t64x128": 95.0,
                                                       "ours:broken": 10.0},
                        chosen="cublas", status={"ours:broken": "wrong: rel_err 1e+00"}))
    s = rep.per_shape(rows)
    g = s[s["mode"] == "graph"].iloc[0]
    assert g.best_ours == "t128x256" and g.best_us == 80.0 and g.ours_timed == 2
    assert g.chosen_vs_best == pytest.approx(0.8) and g.chosen_vs_cublas == pytest.approx(1.0)
    assert g.ours_vs_cublas == pytest.approx(1.25) and g.cold_vs_best == pytest.approx(80 / 90)
    # where cuBLAS is faster than every candidate of ours, the best is cuBLAS
    rows = _frame(_rows(_shape(13955, 632, 3464, cls="narrow"), {"ours": 100.0, "cold": 160.0, "cublas": 100.0,
                                                                   "ours:t128x64": 164.0}, chosen="cublas"))
    g = rep.per_shape(rows).iloc[0]
    assert g.chosen_vs_best == 1.0 and g.ours_vs_cublas == pytest.approx(100 / 164)


def _synthetic():
    """4 held-out shapes (2 large unaligned), 3 fresh; ours alone behind cuBLAS on one fresh shape."""
    parts = [
        _rows(_shape(8191, 8193, 1027, cls="bigpad"), {"ours": 300.0, "cold": 300.0, "cublas": 1000.0,
                                                       "ours:t128x256": 300.0}, "t128x256", source="cold"),
        _rows(_shape(4500, 4500, 4500, cls="bigpad", dtype="float16"),
              {"ours": 600.0, "cold": 600.0, "cublas": 840.0, "ours:t128x256": 600.0}, "t128x256", source="cold"),
        _rows(_shape(4096, 4096, 4096), {"ours": 100.0, "cold": 101.0, "cublas": 100.0, "ours:gl_pp": 101.0},
              "cublas"),
        _rows(_shape(16, 4096, 4096), {"ours": 20.0, "cold": 25.0, "cublas": 24.0, "ours:swap": 20.0}, "swap"),
        _rows(_shape(7214, 3384, 6840, "fresh"), {"ours": 500.0, "cold": 505.0, "cublas": 500.0,
                                                  "ours:gl_pp": 505.0}, "cublas", source="cold"),
        _rows(_shape(13062, 15824, 1568, "fresh"), {"ours": 1000.0, "cold": 1000.0, "cublas": 1050.0,
                                                    "ours:gl_coop": 1000.0}, "gl_coop", source="cold"),
        _rows(_shape(9000, 1000, 3000, "fresh", cls="narrow"), {"ours": 100.0, "cold": 110.0, "cublas": 100.0,
                                                                "ours:t128x64": 156.0}, "cublas", source="cold"),
    ]
    return rep.per_shape(_frame(*parts))


def test_summary_per_set_and_mode_with_both_sets_together():
    s = rep.summary(_synthetic())
    assert set(zip(s.set, s["mode"])) == {(x, m) for x in ("held_out", "fresh", "all") for m in ("graph", "eager")}
    allg = s[(s.set == "all") & (s["mode"] == "graph")].iloc[0]
    assert allg.shapes == 7 and allg.chosen_vs_best_geomean == pytest.approx(1.0)
    fresh = s[(s.set == "fresh") & (s["mode"] == "graph")].iloc[0]
    assert fresh.ours_vs_cublas_geomean == pytest.approx(rep.geomean([500 / 505, 1.05, 100 / 156]))
    assert fresh.ours_vs_cublas_min == pytest.approx(100 / 156) and fresh[f"ours_below_{rep.OURS_FRESH_MIN}"] == 1
    assert fresh.library_chosen == 2 and fresh.tuned_or_table == 0
    # every table shows as chosen and ours alone side by side
    for table in (s, rep.by_class(_synthetic())):
        assert {"chosen_vs_best_geomean", "chosen_vs_cublas_geomean", "ours_vs_cublas_geomean",
                "cold_vs_best_geomean"} <= set(table.columns)


def test_per_class_table_and_the_goals():
    shapes = _synthetic()
    c = rep.by_class(shapes)
    big = c[(c.set == "held_out") & (c["class"] == "bigpad") & (c["mode"] == "graph")].iloc[0]
    assert big.shapes == 2 and big.chosen_vs_cublas_geomean == pytest.approx(math.sqrt(1000 / 300 * 840 / 600))
    g = rep.goals(shapes)
    graph = g[g["mode"] == "graph"].set_index("goal")
    assert graph.loc["as chosen / best of ours and cuBLAS, geomean (held-out + fresh)", "met"]
    big_gm = graph.loc["as chosen vs cuBLAS, geomean (large unaligned)"]
    assert big_gm.value == pytest.approx(math.sqrt(1000 / 300 * 840 / 600)) and big_gm.met   # 2.16x
    assert not graph.loc["as chosen vs cuBLAS, least (large unaligned)", "met"]               # 1.40 < 1.5
    assert not graph.loc["ours alone vs cuBLAS, least (fresh)", "met"]                        # 0.64 < 0.85
    # the rule's class also holds unaligned problems with a size under 1024; issue 43's goal does not
    mid = rep.per_shape(_frame(_rows(_shape(3472, 5470, 187, cls="bigpad"), {"ours": 30.0, "cold": 30.0,
                                                                             "cublas": 36.0, "ours:t128x256": 30.0},
                                      "t128x256", source="cold")))
    with_mid = rep.goals(pd.concat([shapes, mid])).set_index(["mode", "goal"])
    assert with_mid.loc[("graph", "as chosen vs cuBLAS, least (large unaligned)"), "value"] == pytest.approx(840 / 600)
    # no shapes of a kind: not judged
    none = rep.goals(shapes[shapes["class"] != "bigpad"]).set_index(["mode", "goal"])
    assert none.loc[("graph", "as chosen vs cuBLAS, geomean (large unaligned)"), "met"] is None


def test_paths_summary_against_the_host_time_goals():
    def row(case, impl, us, kind, padded=False):
        return {"case": case, "impl": impl, "host_us": us, "host_calls": 300, "kind": kind, "padded": padded}

    rows = []
    for i, (mm, lib, sel, tma, pad) in enumerate([(15.0, 16.0, 16.0, 17.0, 30.0), (14.0, 16.1, 16.1, 16.0, 28.0)]):
        case = f"paths {i}x8x8"
        rows += [row(case, "torch.mm", mm, "torch.mm"), row(case, "cublas [library]", lib, "library"),
                 row(case, "matmul (selected)", sel, "library"), row(case, "t128x256 [persistent]", tma, "tma"),
                 row(case, "t128x128 [persistent]", pad, "tma", padded=True)]
    df = pd.DataFrame(rows)
    df["ratio_vs_torch_mm"] = df.host_us / df.groupby("case").host_us.transform(
        lambda x: float(x[df.loc[x.index, "impl"] == "torch.mm"].iloc[0]))
    s = rep.paths_summary(df).set_index("path")
    assert s.loc["library", "ratio_max"] == pytest.approx(16.1 / 14) and not s.loc["library", "met"]   # 1.15 > 1.1
    assert s.loc["selected: library", "goal"] == rep.HOST_LIBRARY
    assert s.loc["tma", "met"] and s.loc["tma", "goal"] == rep.HOST_OURS                             # 1.14 <= 1.2
    assert not s.loc["tma (padded)", "met"] and s.loc["tma (padded)", "shapes"] == 2
    assert s.loc["tma", "calls_min"] == 300


def test_fresh_shapes_come_from_the_seed():
    a = rgs.fresh_shapes(20, seed=123)
    assert a == rgs.fresh_shapes(20, seed=123) and a != rgs.fresh_shapes(20, seed=124)
    assert all(s["N"] % 8 == 0 and s["K"] % 8 == 0 and 1 <= s["M"] <= 16384 for s in a)
    assert {s["split"] for s in a} == {"fresh-123"} and rgs.fresh_shapes(3, day="20261128") == \
        rgs.fresh_shapes(3, seed=20261128)
    # the tune-on-miss shapes come after the verified ones
    assert rgs.fresh_shapes(2, seed=123, skip=20) == rgs.fresh_shapes(22, seed=123)[20:]


def test_the_report_is_written_from_the_rows_of_a_run(tmp_path):
    """What a run leaves (verify.csv with matmul as 'ours', candidates.csv) -> report.md and the
    tables; the fresh shapes' seed at its head; --report-only writes it again."""
    verify, cands = [], []
    for r in [*_rows(_shape(8191, 8193, 1027, cls="bigpad"), {"ours": 300.0, "cold": 300.0, "cublas": 1000.0,
                                                              "ours:t128x256": 300.0, "ours:ptr": 900.0},
                     "t128x256", source="cold"),
              *_rows(_shape(7214, 3384, 6840, "fresh"), {"ours": 500.0, "cold": 505.0, "cublas": 500.0,
                                                         "ours:gl_pp": 505.0}, "cublas", source="cold")]:
        (cands if r["method"].startswith("ours:") else verify).append(dict(r, device_name="NVIDIA H200",
                                                                           git_sha="abc1234"))
    pd.DataFrame(verify).to_csv(tmp_path / "verify.csv", index=False)
    pd.DataFrame(cands).to_csv(tmp_path / "candidates.csv", index=False)
    assert rgs.main(["--out", str(tmp_path), "--report-only"]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "NVIDIA H200" in text and "seed 20261129" in text and "## Per region class" in text
    shapes = pd.read_csv(tmp_path / "selection_shapes.csv")
    assert len(shapes) == 4 and set(shapes.best_ours) == {"t128x256", "gl_pp"}
    goals = pd.read_csv(tmp_path / "selection_goals.csv")
    assert len(goals) == 12 and set(goals["mode"]) == {"graph", "eager"}
    assert (tmp_path / "selection_summary.csv").exists() and (tmp_path / "selection_by_class.csv").exists()


def test_rows_of_a_resumed_run_line_up_with_the_first_runs(tmp_path):
    path = tmp_path / "verify.csv"
    rgs._append(path, pd.DataFrame([{"M": 1, "N": 2, "group": "regions", "median_us": 3.0}]))
    rgs._append(path, pd.DataFrame([{"median_us": 4.0, "M": 5, "N": 6, "extra": "x"}]))
    df = pd.read_csv(path)
    assert list(df.columns) == ["M", "N", "group", "median_us"] and list(df.median_us) == [3.0, 4.0]
    assert list(df.M) == [1, 5] and df.group.isna().tolist() == [False, True]
