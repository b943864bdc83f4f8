"""workbench.sweep: spec validation, expansion, failure isolation, resume,
provenance in rows, progress output, the CLI; and a quick GEMM sweep in the
interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import yaml

from workbench import sweep
from workbench.sweep import SpecError

ROOT = Path(__file__).resolve().parents[1]

FAKE_KERNEL = textwrap.dedent('''
    """A fast fake kernel module implementing the sweep protocol (torch on CPU)."""
    import torch

    from workbench.dtypes import element_size

    PARAMS = {"scale": 1, "mode": "ok", "tile": 16}
    CALLS = []

    class OutOfResources(Exception):
        pass

    def make_inputs(shape, dtype, device, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape["n"], generator=g).to(dtype)
        return {"x": x, "out": torch.empty_like(x)}

    def poison(inputs):
        inputs["out"].fill_(float("nan"))

    def run(inputs, scale=1, mode="ok", tile=16):
        CALLS.append((scale, mode, tile))
        if mode == "boom":
            raise RuntimeError("kernel exploded")
        if mode == "oor":
            raise OutOfResources("out of resource: shared memory, Required: 300000, Hardware limit: 232448")
        if mode == "nan":
            return inputs["out"]  # never written: still poisoned
        y = inputs["x"] * 2
        if mode == "wrong":
            y = y + 1
        inputs["out"].copy_(y)
        return inputs["out"]

    def reference(inputs):
        return inputs["x"].double() * 2

    def flops(shape):
        return shape["n"]

    def bytes_moved(shape, dtype):
        return 2 * shape["n"] * element_size(dtype)

    def tolerance(dtype):
        return 1e-3

    def derived(shape, dtype, params):
        return {"work": shape["n"] * params.get("tile", 16)}

    def label(params):
        return f"s{params.get('scale')} {params.get('mode')} t{params.get('tile')}"

    baselines = {"eager": lambda inputs: inputs["out"].copy_(inputs["x"] * 2)}
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    name = f"fake_kernel_{abs(hash(str(tmp_path))) % 10**8}"
    (mod_dir / f"{name}.py").write_text(FAKE_KERNEL)
    monkeypatch.syspath_prepend(str(mod_dir))
    monkeypatch.setenv("WORKBENCH_KERNEL_PACKAGES", name)  # a module outside the project: allowed by name
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # host timer: fast and deterministic
    return name


def spec_dict(kernel, **over):
    d = {
        "name": "fake",
        "kernel": kernel,
        "dtypes": ["float32"],
        "bench": {"warmup_ms": 0, "rep_ms": 0},
        "shapes": {"small": [{"n": [64, 128]}], "big": [{"n": 1024}]},
        "defaults": {"tile": 16},
        "grid": [
            {"study": "modes", "shapes": ["small"], "params": {"mode": ["ok", "boom", "wrong", "oor", "nan"]}},
            {"study": "scale", "params": {"scale": [1, 2, 3], "tile": [16, 32]}},
        ],
        "constraints": ["work <= 1024 * 16"],
        "baselines": ["eager"],
        "quick": {"shapes": {"small": [{"n": 8}], "big": [{"n": 16}]},
                  "grid": [{"study": "q", "params": {"scale": [1]}}]},
    }
    d.update(over)
    return d


def write_spec(tmp_path, d, name="fake.yaml"):
    p = tmp_path / "experiments" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return p


# --------------------------------------------------------------- validation
@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.update(colour="red"), "colour"),
    (lambda d: d.update(kernel="no.such.module_xyz"), "kernel"),
    (lambda d: d.update(kernel="3bad name"), "kernel"),
    (lambda d: d.update(dtypes=["float8"]), "dtypes[0]"),
    (lambda d: d["shapes"]["small"].append({"n": None}), "shapes.small[1].n"),  # text is a name now
    (lambda d: d["shapes"]["big"].append("n=3"), "shapes.big[1]"),
    (lambda d: d["grid"][1]["params"].update(blok=[1]), "grid[1].params.blok"),
    (lambda d: d["grid"][0].update(shapes=["nope"]), "grid[0].shapes"),
    (lambda d: d["grid"][0].update(colour=1), "grid[0].colour"),
    (lambda d: d["grid"][1].update(configs=[{"scale": [1, 2]}]), "grid[1].configs[0].scale"),
    (lambda d: d.update(constraints=["work <= "]), "constraints[0]"),
    (lambda d: d.update(constraints=["wrok <= 3"]), "constraints[0]"),
    (lambda d: d.update(baselines=["cudnn"]), "baselines[0]"),
    (lambda d: d.update(repeats=0), "repeats"),
    (lambda d: d.update(bench={"rep_ms": -1}), "bench.rep_ms"),
    (lambda d: d.update(bench={"flush": True}), "bench.flush"),
    (lambda d: d.update(world_size=2), "world_size"),
    (lambda d: d.update(defaults={"tile": [1, 2]}), "defaults.tile"),
    (lambda d: d.update(constraints=["work < 0"]), "grid"),
])
def test_bad_spec_names_the_field(fake, tmp_path, mutate, field):
    d = spec_dict(fake)
    mutate(d)
    with pytest.raises(SpecError) as ei:
        sweep.load_spec(write_spec(tmp_path, d))
    msg = str(ei.value)
    assert f"{field}:" in msg, msg
    assert "fake.yaml" in msg


def test_quick_validation(fake, tmp_path):
    d = spec_dict(fake)
    d["quick"] = {"kernel": "x"}
    with pytest.raises(SpecError, match=r"quick\.kernel"):
        sweep.load_spec(write_spec(tmp_path, d), quick=True)
    d = spec_dict(fake)
    del d["quick"]
    with pytest.raises(SpecError, match="quick"):
        sweep.load_spec(write_spec(tmp_path, d), quick=True)
    d = spec_dict(fake)
    d["quick"]["shapes"] = {"small": [{"n": [8, [16]]}]}
    with pytest.raises(SpecError, match=r"quick\.shapes\.small\[0\]\.n"):
        sweep.load_spec(write_spec(tmp_path, d), quick=True)


def test_a_module_outside_the_project_is_not_imported(tmp_path, monkeypatch):
    canary = tmp_path / "canary"
    (tmp_path / "side_effect_mod.py").write_text(f"open({str(canary)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("side_effect_mod", "antigravity", "this", "side_effect_mod.sub"):
        with pytest.raises(SpecError, match="kernel: .* is not a module of this project"):
            sweep.load_spec(write_spec(tmp_path, spec_dict(name)))
    assert not canary.exists()


def test_missing_protocol_function(tmp_path, monkeypatch):
    (tmp_path / "half_kernel_mod.py").write_text("def run(inputs):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WORKBENCH_KERNEL_PACKAGES", "other, half_kernel_mod")
    with pytest.raises(SpecError, match="kernel: half_kernel_mod lacks make_inputs"):
        sweep.load_spec(write_spec(tmp_path, spec_dict("half_kernel_mod")))


def test_not_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        sweep.load_spec(p)
    with pytest.raises(SpecError, match="no such experiment"):
        sweep.load_spec(tmp_path / "missing.yaml")


def test_cli_error_exit_2_no_traceback(fake, tmp_path, capsys):
    from workbench import cli

    d = spec_dict(fake)
    d["grid"][1]["params"]["blok"] = [1]
    p = write_spec(tmp_path, d)
    assert cli.main(["sweep", str(p)]) == 2
    err = capsys.readouterr().err
    assert "grid[1].params.blok" in err and "Traceback" not in err


# ------------------------------------------------------------- shape values
def test_shape_values_may_be_ints_floats_and_names():
    shape = {"n": [64, 128], "routing": ["uniform", "zipf"], "skew": 1.5, "model": "deepseek-v3"}
    spec = sweep.parse_spec({"name": "s", "kernel": "k", "shapes": [shape]}, import_kernel=False)
    shapes = spec.shapes["default"]
    assert len(shapes) == 4
    assert shapes[0] == {"n": 64, "routing": "uniform", "skew": 1.5, "model": "deepseek-v3"}
    assert {(s["n"], s["routing"]) for s in shapes} == {(64, "uniform"), (64, "zipf"), (128, "uniform"),
                                                       (128, "zipf")}
    assert all(type(s["n"]) is int and type(s["skew"]) is float for s in shapes)


@pytest.mark.parametrize("value,why", [
    (None, "null"),
    (True, "bool"),
    ([4, False], "bool"),
    ([], "non-empty list"),
    ([[64, 128]], "lists do not nest"),
    ({"a": 1}, "a mapping is not a value"),
    ([64, {"a": 1}], "a mapping is not a value"),
    (-1, "negative"),
    (-0.5, "negative"),
    (float("nan"), "non-finite"),
    (float("inf"), "non-finite"),
    ("", "empty text"),
])
def test_bad_shape_value_names_the_field(tmp_path, value, why):
    d = {"kernel": "k", "shapes": {"small": [{"n": 64}, {"n": 64, "routing": value}]}}
    with pytest.raises(SpecError) as ei:
        sweep.load_spec(write_spec(tmp_path, d), import_kernel=False)
    msg = str(ei.value)
    assert "fake.yaml" in msg and "shapes.small[1].routing:" in msg, msg
    assert why in msg, msg


def test_named_shape_values_reach_the_rows(fake, tmp_path):
    d = spec_dict(fake, shapes=[{"n": 64, "routing": ["uniform", "zipf"], "skew": 0.5}],
                  grid={"scale": [1]}, constraints=[])
    del d["quick"]
    df = sweep.run_spec(write_spec(tmp_path, d), results_dir=tmp_path / "out", progress=False)
    assert set(df["status"]) == {"ok"}
    assert sorted(df.loc[~df["is_baseline"], "routing"]) == ["uniform", "zipf"]
    assert set(df["skew"]) == {0.5} and set(df["n"]) == {64}
    assert {json.loads(s)["routing"] for s in df["shape"]} == {"uniform", "zipf"}


# ---------------------------------------------------------------- expansion
def test_expand(fake, tmp_path):
    spec = sweep.load_spec(write_spec(tmp_path, spec_dict(fake)))
    pts = sweep.expand(spec)
    kern = [p for p in pts if p.baseline is None]
    base = [p for p in pts if p.baseline]
    # modes: 5 modes x 2 small shapes; scale: 3 x 2 tiles x 3 shapes, minus n=1024 & tile=32
    # (constraint), minus duplicates of (n, scale=1, tile=16, mode=ok) already in "modes".
    assert len([p for p in kern if p.study == "modes"]) == 10
    assert len([p for p in kern if p.study == "scale"]) == 3 * 2 * 3 - 3 - 2
    assert len(base) == 3  # one per shape
    assert all(p.params_dict["tile"] in (16, 32) for p in kern)
    ids = [p.point_id(spec.kernel) for p in pts]
    assert len(set(ids)) == len(ids)
    q = sweep.load_spec(write_spec(tmp_path, spec_dict(fake)), quick=True)
    assert {p.shape_dict["n"] for p in sweep.expand(q)} == {8, 16}


# ---------------------------------------------------------------------- run
def test_run_isolates_failures_records_provenance_and_resumes(fake, tmp_path, capsys):
    p = write_spec(tmp_path, spec_dict(fake))
    out = tmp_path / "results" / "fake"
    df = sweep.run_spec(p, results_dir=out, flush_every=3)
    err = capsys.readouterr().err
    assert "sweep fake" in err  # progress bar and summary on stderr
    assert (out / "rows.parquet").exists() and not (out / "inflight.json").exists()
    n_points = len(sweep.expand(sweep.load_spec(p)))
    assert len(df) == n_points
    st = df.set_index("config")["status"].to_dict()
    assert st["s1 boom t16"] == "runtime_error"
    assert st["s1 wrong t16"] == "wrong_result"
    assert st["s1 oor t16"] == "out_of_resources"
    assert st["s1 nan t16"] == "wrong_result"
    assert (df["status"] == "ok").sum() == n_points - 4 * 2
    boom = df[df.config == "s1 boom t16"].iloc[0]
    assert "kernel exploded" in boom["error"]
    nan = df[df.config == "s1 nan t16"].iloc[0]
    assert "not finite" in nan["error"]
    ok = df[df.status == "ok"]
    assert ok["median_ms"].gt(0).all() and ok["n_runs"].ge(1).all()
    assert not ok["is_performance"].any()  # host timer
    assert ok["rel_err"].le(1e-3).all()
    for col in ("git_sha", "git_dirty", "torch_version", "triton_version", "cuda_version", "device_name",
                "device_count", "world_size", "knobs", "timestamp", "hostname", "flops", "bytes", "tflops",
                "p_scale", "p_mode", "p_tile", "params", "point_id", "variant", "study", "n"):
        assert col in df.columns, col
    assert set(df.variant) == {"triton", "eager"}
    assert json.loads(df.knobs.iloc[0])["sweep"] == "fake"

    # Resume: nothing new runs.
    mod = sys.modules[fake]
    mod.CALLS.clear()
    df2 = sweep.run_spec(p, results_dir=out)
    assert mod.CALLS == [] and len(df2) == len(df)
    assert "0 rows run" in capsys.readouterr().err

    # A new grid value: only the new points run.
    d = spec_dict(fake)
    d["grid"][1]["params"]["scale"].append(4)
    p2 = write_spec(tmp_path, d)
    df3 = sweep.run_spec(p2, results_dir=out, progress=False)
    assert len(df3) == len(df) + 3 * 2 - 1  # 3 shapes x 2 tiles, minus n=1024 x tile=32
    assert {c[0] for c in mod.CALLS} == {4}


def test_crashed_point_is_recorded_and_skipped(fake, tmp_path):
    p = write_spec(tmp_path, spec_dict(fake))
    out = tmp_path / "res"
    spec = sweep.load_spec(p)
    victim = sweep.expand(spec)[0]
    out.mkdir()
    (out / "inflight.json").write_text(json.dumps(
        {"point_id": victim.point_id(spec.kernel), "variant": "triton", "repeat": 0}))
    df = sweep.run_spec(p, results_dir=out, progress=False)
    crashed = df[df.status == "crashed"]
    assert len(crashed) == 1 and crashed.iloc[0]["point_id"] == victim.point_id(spec.kernel)
    assert len(df) == len(sweep.expand(spec))


def test_limit_deadline_repeats_and_fresh(fake, tmp_path):
    d = spec_dict(fake, repeats=2)
    p = write_spec(tmp_path, d)
    out = tmp_path / "r"
    df = sweep.run_spec(p, results_dir=out, limit=5, progress=False)
    assert len(df) == 5
    df = sweep.run_spec(p, results_dir=out, deadline_s=0.0, progress=False)
    assert len(df) == 5  # nothing started after the deadline
    df = sweep.run_spec(p, results_dir=out, progress=False)
    assert len(df) == 2 * len(sweep.expand(sweep.load_spec(p)))
    assert set(df["repeat"]) == {0, 1}
    df = sweep.run_spec(p, results_dir=out, resume=False, limit=2, progress=False)
    assert len(df) == 2 and list(out.glob("rows.*.parquet.bak"))


def test_best_per_shape_and_load_rows(fake, tmp_path):
    p = write_spec(tmp_path, spec_dict(fake))
    out = tmp_path / "results" / "fake"
    sweep.run_spec(p, results_dir=out, progress=False)
    df = sweep.load_rows(out)
    best = sweep.best_per_shape(df, shape_cols=["n"], baseline="eager")
    assert len(best) == 3 and (best.status == "ok").all()
    assert "speedup_vs_eager" in best


def test_cli_dry_run_and_run(fake, tmp_path, capsys):
    from workbench import cli

    p = write_spec(tmp_path, spec_dict(fake))
    assert cli.main(["sweep", str(p), "--dry-run"]) == 0
    assert "spec OK" in capsys.readouterr().out
    out = tmp_path / "cli-results"
    assert cli.main(["sweep", str(p), "--quick", "--results", str(out)]) == 0
    assert len(pd.read_parquet(out / "rows.parquet")) == 4  # 2 shapes x (1 config + 1 baseline)
    assert "sweep fake" in capsys.readouterr().err


def test_gemm_spec_is_valid():
    spec = sweep.load_spec(ROOT / "experiments" / "gemm_tiling.yaml")
    pts = sweep.expand(spec)
    assert sum(p.baseline is None for p in pts) >= 1000  # the 1,000-point scatter
    assert {s.name for s in spec.studies} >= {"tiles", "stages", "group", "sms"}


def test_gemm_quick_sweep_in_interpreter(tmp_path):
    """The real GEMM spec, --quick, through the CLI, in Triton's interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "sweep", "experiments/gemm_tiling.yaml", "--quick",
                        "--results", str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    df = pd.read_parquet(tmp_path / "rows.parquet")
    assert (df.status == "ok").all(), df[["config", "status", "error"]].to_string()
    assert not df.is_performance.any()
    assert "not performance" in r.stderr


def test_resume_counts_only_rows_from_this_device(fake, tmp_path):
    p = write_spec(tmp_path, spec_dict(fake))
    out = tmp_path / "dev"
    df = sweep.run_spec(p, results_dir=out, progress=False)
    df["device_name"] = "Some Other GPU"  # e.g. committed H200 rows read on a laptop
    df.to_parquet(out / "rows.parquet", index=False)
    df2 = sweep.run_spec(p, results_dir=out, progress=False)
    assert len(df2) == 2 * len(df)  # everything ran again here; the other rows are kept
    assert set(df2.device_name) == {"Some Other GPU", "cpu"}
