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
