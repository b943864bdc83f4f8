"""experiments/fit_gemm_cold_rule.py on synthetic tuning times (CPU): the region table is fitted
on the fit half only, kept only when cross-validation says it beats the cost model, and both
rules are reported on the held-out and fresh shapes."""
from __future__ import annotations

import csv
import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("fit_gemm_cold_rule", ROOT / "experiments" / "fit_gemm_cold_rule.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_times(path: Path, shapes, fastest: str, seed: int) -> None:
    """Every candidate of each shape timed on two GPUs; ``fastest`` wins by 20% wherever it exists,
    cuBLAS sits between."""
    from kernels.gemm import select as gselect, tuning as gtuning

    fit = _script()
    rng = random.Random(seed)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["device", "family", "key", "shape", "candidate", "us", "rel_spread", "status", "winner", "cold",
                    "how", "date", "git"])
        for dev in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
            for s in shapes:
                call = fit.fake_call(s)
                key = gtuning.key_of(gtuning.shape_of(s))
                names = [n for n in gselect.candidates(call)]
                base = 100.0 * rng.uniform(0.5, 2)
                for n in names:
                    us = base * (0.8 if n == fastest else rng.uniform(1.0, 1.5))
                    if n == "cublas":
                        us = base * 0.9
                    w.writerow([dev, "gemm", key, json.dumps(s), n, us, 0.01, "ok", "", "", "", "", ""])


def test_fit_keeps_a_region_table_that_wins_and_reports_held_out(tmp_path):
    rng = random.Random(3)
    shapes = []
    for i in range(40):
        M, N, K = rng.choice([600, 2048, 5000]), rng.choice([4096, 6144]), rng.choice([2048, 4096])
        shapes.append(dict(M=M + i, N=N, K=K, dtype="bfloat16", split=["fit", "held_out", "fresh-20261128"][i % 3]))
    times = tmp_path / "times.csv"
    _write_times(times, shapes, "t64x128", seed=1)
    fit = _script()
    rule = tmp_path / "cold_rule.json"
    fit.RULE_PATH = rule
    assert fit.main(["--times", str(times), "--out", str(tmp_path / "out"), "--write-rule"]) == 0
    doc = json.loads(rule.read_text())
    assert doc["rule"] == "regions" and set(doc["regions"].values()) == {"t64x128"}
    assert doc["cv_regret"]["regions"] < doc["cv_regret"]["cost model"]
    import pandas as pd

    summ = pd.read_csv(tmp_path / "out" / "cold_rule_summary.csv")
    held = summ[(summ.rule == "regions") & (summ.set == "held_out")]
    assert len(held) == 2 and list(held.regret_geomean) == pytest.approx([1.0, 1.0])
    assert set(summ.set) == {"fit", "held_out", "fresh"}


def test_region_table_is_what_the_cold_rule_consults(monkeypatch):
    import torch

    from kernels.gemm import cold, select as gselect

    fit = _script()
    call = fit.fake_call(dict(M=3000, N=4096, K=4096, dtype="bfloat16"))
    reg = cold.region(3000, 4096, 4096, torch.bfloat16, True, 132)
    monkeypatch.setattr(cold, "REGIONS", {reg: "t64x128"})
    assert gselect.cold(call).name == "t64x128"
    coarse = cold.regions(3000, 4096, 4096, torch.bfloat16, True, 132)[-1]   # only a coarser region known
    monkeypatch.setattr(cold, "REGIONS", {coarse: "t128x128"})
    assert gselect.cold(call).name == "t128x128"
    monkeypatch.setattr(cold, "REGIONS", {reg: "no-such-candidate"})   # falls back to the cost model
    assert gselect.cold(call).name != "no-such-candidate"


def test_a_damaged_rule_file_names_itself(tmp_path):
    from kernels.gemm import cold

    bad = tmp_path / "cold_rule.json"
    bad.write_text('{"regions": [1, 2]}')
    with pytest.raises(ValueError, match="cold_rule.json.*fit_gemm_cold_rule"):
        cold.load_regions(bad)
    assert cold.load_regions(tmp_path / "absent.json") == {}


# ------------------------------------------------------- large unaligned, narrow and long-K problems
def _unaligned_large(n: int, seed: int):
    """Shapes with M, N, K >= 1024 whose rows (A: K; B: N, or K when B is a transposed view;
    C: N) are not all multiples of 8 elements, fp16 and bf16, B row-major or transposed."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        M, N, K = (rng.randint(1024, 16384) for _ in range(3))
        if N % 8 == 0 and K % 8 == 0:
            continue
        out.append(dict(M=M, N=N, K=K, dtype=rng.choice(["bfloat16", "float16"]), b=rng.choice(["row", "t"])))
    return out


@pytest.mark.parametrize("shape", [dict(M=4500, N=4500, K=4500, dtype="float16"),    # issue 43's, cuBLAS 0.84 ms
                                   dict(M=8191, N=8193, K=1027, dtype="bfloat16"),
                                   dict(M=1024, N=1024, K=1025, dtype="bfloat16"),     # A's rows only
                                   dict(M=3000, N=4097, K=2048, dtype="float16"),      # B's and C's rows
                                   dict(M=3000, N=4097, K=2048, dtype="bfloat16", b="t"),   # C's rows only
                                   dict(M=2048, N=2048, K=3001, dtype="float16", b="t")])   # A's and B's
def test_cold_rule_runs_ours_padded_on_large_unaligned_shapes(shape):
    """The rule as shipped: a large unaligned problem is in the bigpad class, whose regions the
    rule was fitted on (the region shapes' fit half, one H200: results/gemm_selection/h200_regions/
    and h200_rule_classes/), and a padded persistent TMA kernel of ours runs (the tile by region:
    128x128 under one round of tiles, 128x256 from one round), not the library."""
    from kernels.gemm import cold, select as gselect

    call = _script().fake_call(shape)
    assert not call.aligned and cold.shape_class(call.M, call.N, call.K, call.dtype, False, 132) == "bigpad"
    assert any(r.startswith("bigpad") for r in cold.REGIONS)
    cand = gselect.cold(call)
    assert cand.name in ("t128x256", "t128x128") and cand.variant == "persistent" and cand.config.pad, cand
    p = gselect.variants.VARIANTS[cand.variant].plan(call, cand.config, explicit=True)
    assert p.kind == "tma" and (p.pad_a > 0) == (not call.a_ok) and (p.pad_b > 0) == (not call.b_ok)


def test_cold_rule_never_gives_the_library_a_large_unaligned_shape():
    """200 random large unaligned problems, fp16 and bf16, both B layouts: always one of ours."""
    from kernels.gemm import select as gselect

    fit = _script()
    for s in _unaligned_large(200, seed=43):
        cand = gselect.cold(fit.fake_call(s))
        assert cand.name != "cublas" and cand.variant != "library", s


def test_a_fitted_class_region_wins_over_the_default_and_the_general_regions(monkeypatch):
    from kernels.gemm import cold, select as gselect

    call = _script().fake_call(dict(M=8191, N=8193, K=1027, dtype="bfloat16"))
    regs = cold.regions(call.M, call.N, call.K, call.dtype, False, 132)
    assert regs[0].startswith("bigpad,16,pad,") and regs[2] == "bigpad"
    monkeypatch.setattr(cold, "REGIONS", {regs[1]: "t128x128", regs[-1]: "cublas"})
    assert gselect.cold(call).name == "t128x128"
    # narrow and long-K shapes have no default: without their class regions the general ones serve
    for shape, cls in ((dict(M=13955, N=632, K=3464), "narrow"), (dict(M=768, N=768, K=49152), "longk")):
        c = _script().fake_call(dict(shape, dtype="bfloat16"))
        assert cold.shape_class(c.M, c.N, c.K, c.dtype, c.aligned, 132) == cls
        general = cold.general_regions(c.M, c.N, c.K, c.dtype, c.aligned, 132)
        monkeypatch.setattr(cold, "REGIONS", {general[-1]: "cublas"})
        assert cold.region_pick(c.M, c.N, c.K, c.dtype, c.aligned, 132) == ("cublas", general[-1])
        monkeypatch.setattr(cold, "REGIONS", {general[-1]: "cublas", f"{cls},16,tma": "t128x128"})
        assert cold.region_pick(c.M, c.N, c.K, c.dtype, c.aligned, 132) == ("t128x128", f"{cls},16,tma")


def test_a_region_with_few_fit_shapes_takes_the_best_worst_case():
    """Two shapes in a region: 'a' and 'b' are each best on one and 2x off on the other
    (geomean regret 1.41), 'c' 1.5x off on both (1.5). With at least 2 shapes required the
    geomean picks 'a'; with 3 required the region has too few, and the best worst case ('c')
    is taken."""
    fit = _script()
    recs = [{"key": "s1", "region": ["r"], "us": {"a": 1.0, "b": 2.0, "c": 1.5, "cublas": 3.0}},
            {"key": "s2", "region": ["r"], "us": {"a": 2.0, "b": 1.0, "c": 1.5, "cublas": 3.0}}]
    table, info = fit.fit_regions(recs, min_shapes=2)
    assert table == {"r": "a"} and info["r"] == {"shapes": 2, "how": fit.GEOMEAN}
    table, info = fit.fit_regions(recs, min_shapes=3)
    assert table == {"r": "c"} and info["r"]["how"] == fit.WORST
    # cuBLAS is a candidate like the others: where it is the best worst case it is taken
    recs[0]["us"]["cublas"] = recs[1]["us"]["cublas"] = 1.4
    assert fit.fit_regions(recs, min_shapes=3)[0] == {"r": "cublas"}


def test_refit_reports_held_out_regret_per_region_class(tmp_path):
    """Times for every class (bigpad only held out: no fit points, so its default serves it), the
    rule refitted: class regions in the rule, and held-out regret per class in
    cold_rule_regions.csv and the summary."""
    import pandas as pd

    shapes = []
    rng = random.Random(5)
    for i in range(12):
        shapes.append(dict(M=5000 + 7 * i, N=rng.choice([256, 512, 1024]), K=2048, dtype="bfloat16",
                           split="fit" if i % 2 else "held_out"))                        # narrow
        shapes.append(dict(M=512 + 8 * i, N=768, K=32768, dtype="bfloat16",
                           split="fit" if i % 2 else "held_out"))                        # longk
        shapes.append(dict(M=2000 + i, N=6144, K=4096, dtype="bfloat16",
                           split="fit" if i % 2 else "held_out"))                        # other
    shapes += [dict(s, split="held_out") for s in _unaligned_large(4, seed=1)]           # bigpad
    times = tmp_path / "times.csv"
    _write_times(times, shapes, "t64x128", seed=2)
    fit = _script()
    fit.RULE_PATH = tmp_path / "cold_rule.json"
    out = tmp_path / "out"
    assert fit.main(["--times", str(times), "--out", str(out), "--write-rule"]) == 0
    doc = json.loads(fit.RULE_PATH.read_text())
    assert {"narrow,16,tma,n,r<1", "longk,16,tma,n,r<1"} <= set(doc["regions"])
    assert not any(k.startswith("bigpad") for k in doc["regions"]) and doc["region_info"]["narrow"]["shapes"] == 6
    regions = pd.read_csv(out / "cold_rule_regions.csv")
    held = regions[(regions.rule == "regions") & (regions.set == "held_out")]
    assert set(held["class"]) == {"bigpad", "narrow", "longk", "other"}
    assert list(held[held["class"] == "narrow"].regret_geomean) == pytest.approx([1.0, 1.0])
    report = pd.read_csv(out / "cold_rule_report.csv")
    big = report[(report["class"] == "bigpad") & (report.rule == "regions")]
    assert set(big["pick"]) == {"t128x256"} and big.via.str.contains("no fit points").all()
    assert "Per region class" in (out / "cold_rule_summary.md").read_text()


def test_the_zoo_covers_every_class_in_both_halves():
    """experiments/gemm_shapes.yaml holds fit and held-out shapes of every class the rule keys
    apart: large unaligned ones (fp16 and bf16; A's rows alone, B's and C's, C's alone, all of
    them), narrow N and long K; at least 8 fit shapes each (the fit's --min-shapes is 3)."""
    import sys
    from collections import Counter, defaultdict

    from kernels.gemm import cold

    sys.path.insert(0, str(ROOT / "experiments"))
    from run_gemm_zoo import load_shapes

    fit = _script()
    count = Counter()
    unaligned = defaultdict(set)
    for s in load_shapes():
        call = fit.fake_call(s)
        cls = cold.shape_class(call.M, call.N, call.K, call.dtype, call.aligned, 132)
        count[(cls, s["split"])] += 1
        if cls == "bigpad":
            unaligned[s["split"]].add((s["dtype"], f"{int(call.a_ok)}{int(call.b_ok)}{int(call.c_ok)}"))
    for cls in ("bigpad", "narrow", "longk"):
        assert count[(cls, "fit")] >= 8 and count[(cls, "held_out")] >= 8, (cls, count)
    # TMA flags of A, B, C: 011 A's rows alone unaligned; 100 B's and C's; 110 C's alone (B a
    # transposed view); 001 A's and B's (the same); 000 all three
    for half in ("fit", "held_out"):
        assert {d for d, _ in unaligned[half]} == {"bfloat16", "float16"}
        assert {t for _, t in unaligned[half]} == {"011", "100", "110", "001", "000"}, unaligned[half]


def test_a_refitted_rule_is_tried_through_the_environment(tmp_path):
    """WORKBENCH_GEMM_COLD_RULE names a rule file to use instead of the shipped one (what a GPU
    node's checks run after refitting); a path that is not a file is an error that says so."""
    import os
    import subprocess
    import sys

    rule = tmp_path / "rule.json"
    rule.write_text(json.dumps({"regions": {"bigpad": "t128x128"}}))
    code = ("import json; from kernels.gemm import cold; "
            "print(json.dumps([cold.REGIONS, cold.region_pick(5000, 5001, 5003, __import__('torch').float16, "
            "False, 132)]))")
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORKBENCH_GEMM_COLD_RULE=str(rule))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    regions, picked = json.loads(r.stdout.strip().splitlines()[-1])
    assert regions == {"bigpad": "t128x128"} and picked == ["t128x128", "bigpad"]
    env["WORKBENCH_GEMM_COLD_RULE"] = str(tmp_path / "typo.json")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "WORKBENCH_GEMM_COLD_RULE" in r.stderr and "no such file" in r.stderr


@pytest.mark.parametrize("M, N, K, dtype, aligned, cls", [
    (3472, 5470, 187, torch.bfloat16, False, "bigpad"),   # K small, 7.1 GFLOP: ours 1.9x cuBLAS on an H200
    (8191, 8193, 1000, torch.bfloat16, False, "bigpad"),  # issue 43's example, K under 1024
    (705, 440, 2517, torch.float16, False, "bigpad"),
    (564, 184, 334, torch.bfloat16, False, None),         # 0.07 GFLOP: the padding copies cost as much
    (400, 8192, 8192, torch.bfloat16, False, None),       # M under BIG_MIN_M
    (9423, 513, 1432, torch.bfloat16, False, "narrow"),   # narrow keeps its own regions
    (3472, 5470, 187, torch.bfloat16, True, None),        # aligned: nothing to pad
    (3472, 5470, 187, torch.float32, False, None),
])
def test_bigpad_class_is_unaligned_16_bit_work_not_only_large_sizes(M, N, K, dtype, aligned, cls):
    """The large-unaligned class also holds problems with one small size and enough work (the
    fit half: one of ours 1.00-4.3x cuBLAS on all 11 such records; 12 drawn to check a refit ran
    1.6-3.3x with ours, where a general region sent them to cuBLAS)."""
    from kernels.gemm import cold

    assert cold.shape_class(M, N, K, dtype, aligned, 132) == cls


def test_class_shapes_are_fitted_into_their_class_regions_alone():
    """A long-K shape's times fit its class regions, never a general region: fitted on class shapes
    alone, a general region served the other shapes in it (256 x 16384 x 16384: t64x128, from
    long-K shapes with a tile or two per SM, where cuBLAS ran 1.4x faster)."""
    fit = _script()
    from kernels.gemm import cold

    longk = (256, 4096, 14336, torch.bfloat16, True, 132)
    wide = (256, 16384, 16384, torch.bfloat16, True, 132)
    assert cold.shape_class(*longk) == "longk" and cold.shape_class(*wide) is None
    shared = set(cold.general_regions(*longk)) & set(cold.general_regions(*wide))
    assert shared   # the two share general regions: only the class decides where the times go
    recs = [{"key": "k", "class": "longk", "region": cold.regions(*longk), "us": {"t64x128": 1.0, "cublas": 3.0}},
            {"key": "o", "class": "other", "region": cold.regions(*wide), "us": {"t64x128": 1.6, "cublas": 1.0}}]
    table, _ = fit.fit_regions(recs, min_shapes=1)
    assert all(table[r] == "t64x128" for r in cold.class_regions(*longk))
    assert all(table[r] == "cublas" for r in shared)
    assert cold.region_pick(*wide, table=table)[0] == "cublas"
