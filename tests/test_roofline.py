"""workbench.roofline: the model, the ceilings cache, the figure."""
from __future__ import annotations

import json

import pytest

from workbench import roofline


def test_model_h200_datasheet():
    sheet = roofline.DATASHEETS["NVIDIA H200"]
    ridge = roofline.ridge_point(sheet["bf16_tflops"], sheet["hbm_gbps"])
    assert ridge == pytest.approx(989e12 / 4800e9)  # ~206 FLOP/byte
    assert 200 < ridge < 210
    assert roofline.attainable_tflops(10, 989, 4800) == pytest.approx(48.0)  # memory bound
    assert roofline.attainable_tflops(1000, 989, 4800) == pytest.approx(989.0)  # compute bound
    assert roofline.bound(10, 989, 4800) == "memory"
    assert roofline.bound(1000, 989, 4800) == "compute"
    assert roofline.arithmetic_intensity(2 * 8192 ** 3, 3 * 8192 ** 2 * 2) == pytest.approx(8192 / 3)


def test_slug():
    assert roofline.device_slug("NVIDIA H200") == "nvidia-h200"
    assert roofline.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


FAKE = {"device_name": "Fake GPU 9000", "date": "2026-01-02", "copy_gbps": 1000.0, "bf16_tflops": 100.0,
        "fp16_tflops": 110.0, "peer_gbps": None}


def test_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "user"))
    commit = tmp_path / "results" / "ceilings"
    paths = roofline.save_ceilings(FAKE, commit_dir=commit)
    assert {p.parent for p in paths} == {tmp_path / "user" / "ceilings", commit}
    assert json.loads((commit / "fake-gpu-9000.json").read_text())["bf16_tflops"] == 100.0
    got = roofline.load_ceilings("Fake GPU 9000")
    assert got["copy_gbps"] == 1000.0
    c = roofline.ceilings("Fake GPU 9000")
    assert c["source"] == "measured 2026-01-02" and c["bf16_tflops"] == 100.0 and c["datasheet"] is None


def test_committed_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(roofline, "COMMITTED_DIR", tmp_path / "committed")
    roofline.save_ceilings(FAKE, commit_dir=tmp_path / "committed")
    (tmp_path / "empty" / "ceilings" / "fake-gpu-9000.json").unlink()
    assert roofline.load_ceilings("Fake GPU 9000")["bf16_tflops"] == 100.0


def test_datasheet_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(roofline, "COMMITTED_DIR", tmp_path / "none")
    c = roofline.ceilings("NVIDIA H200")
    assert c["measured"] is None and c["source"] == "datasheet"
    assert c["copy_gbps"] == 4800.0 and c["bf16_tflops"] == 989.0
    assert roofline.ceilings("Unknown GPU")["source"] == "none"


def test_measure_needs_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        roofline.measure_ceilings(save=False)


def test_figure_has_measured_and_datasheet_roofs(tmp_path, monkeypatch):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("plotly")
    ceil = {"device_name": "NVIDIA H200", "measured": {**FAKE, "copy_gbps": 4300.0, "bf16_tflops": 780.0},
            "datasheet": roofline.DATASHEETS["NVIDIA H200"]}
    pts = pd.DataFrame({"flops": [2e12, 2e9], "bytes": [1e9, 1e8], "tflops": [500.0, 20.0],
                        "config": ["a", "b"], "is_performance": [True, True]})
    fig = roofline.figure(pts, ceil)
    names = [t.name for t in fig.data]
    assert any(n.startswith("measured") for n in names)
    assert any(n.startswith("datasheet") for n in names)
    assert {"a", "b"} <= set(names)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"


@pytest.mark.gpu
def test_gpu_measure_ceilings(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    c = roofline.measure_ceilings(gemm_size=2048, copy_bytes=256 << 20, rep_ms=20, save=True)
    assert c["copy_gbps"] > 100 and c["bf16_tflops"] > 10 and c["fp16_tflops"] > 10
    assert c["provenance"]["device_count"] >= 1
    assert roofline.load_ceilings()["date"] == c["date"]


def test_committed_sweep_renders_1000_points():
    """The committed H200 sweep (results/gemm_tiling) has >= 1,000 measured points and plots."""
    pytest.importorskip("plotly")
    from pathlib import Path

    from workbench import plots, sweep

    rows = Path(__file__).resolve().parents[1] / "results" / "gemm_tiling" / "rows.parquet"
    if not rows.exists():
        pytest.skip("no committed sweep results")
    df = sweep.load_rows(rows)
    assert df.is_performance.all() and (df.device_name == "NVIDIA H200").all()
    fig = plots.scatter_mnk(df, roofline.ceilings("NVIDIA H200"))
    kernel_points = sum(len(t.x) for t in fig.data if t.name != "cublas")
    assert kernel_points >= 1000
    assert any(t.name == "cublas" for t in fig.data)
    for study, param in [("stages", "num_stages"), ("group", "group_m"), ("sms", "num_sms")]:
        assert len(plots.study_lines(df, study, param).data) > 0
