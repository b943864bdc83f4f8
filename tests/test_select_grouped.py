"""The grouped GEMM family (kernels.moe) in the selection layer: problem keys, table entries
served or refused, tune-on-miss with a fake timer, no tuning under (simulated) graph capture,
explicit configs untouched, `workbench tune grouped` end to end (CPU, Triton's interpreter),
the layer spec; on a GPU, every entry of a shipped grouped table runs correctly."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from kernels import moe
from kernels.common import interpreter, select, tables, tune
from kernels.moe import config as mconfig, launch, select as mselect
from workbench import tune as wtune, tune_command

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "experiments" / "grouped_gemm_layers.yaml"
interpreted = pytest.mark.skipif(not interpreter.active(),
                                 reason="runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, set by "
                                        "conftest where there is no GPU)")


@pytest.fixture(autouse=True)
def _fresh(isolated_tables):
    """Each test: tables of its own (conftest's isolated_tables) and no plans kept."""
    launch.clear_plans()
    yield
    launch.clear_plans()


SIZES = [5, 0, 11, 7]


def _operands(op, dtype=torch.float16, K=32, N=24, sizes=SIZES, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.tensor(sizes, dtype=torch.int32)
    M, G = sum(sizes), len(sizes)
    w = torch.randn(G, K, N, generator=g).to(dtype)
    if op == "fwd":
        return torch.randn(M, K, generator=g).to(dtype), w, s
    if op == "dgrad":
        return torch.randn(M, N, generator=g).to(dtype), w, s
    return torch.randn(M, K, generator=g).to(dtype), torch.randn(M, N, generator=g).to(dtype), s


def _run(op, a, b, s, **kw):
    if op == "wgrad":
        shape = (s.shape[0], a.shape[1], b.shape[1])
    else:
        shape = (a.shape[0], b.shape[1] if op == "dgrad" else b.shape[2])
    out = torch.full(shape, float("nan"), dtype=a.dtype)
    if op == "wgrad":
        moe.grouped_gemm_wgrad(a, b, s, out=out, **kw)
        ref = moe.reference_wgrad(a, b, s)
    else:
        moe.grouped_gemm(a, b, s, trans_w=op == "dgrad", out=out, **kw)
        ref = moe.reference(a, b, s, trans_w=op == "dgrad")
    err = (out.double() - ref).norm() / ref.norm()
    assert torch.isfinite(out).all() and float(err) < 2e-3, (op, float(err))
    return out


def _plan(op, a, b, s, **kw):
    if op == "wgrad":
        return launch.plan_for_wgrad(a, b, s, out=torch.empty(s.shape[0], a.shape[1], b.shape[1], dtype=a.dtype),
                                     **kw)
    width = b.shape[1] if op == "dgrad" else b.shape[2]
    return launch.plan_for(a, b, s, trans_w=op == "dgrad", out=torch.empty(a.shape[0], width, dtype=a.dtype), **kw)


def _key(op, a, b, s):
    return select.problem_key(mselect.problem(launch._call(op, a, b, s, None)))


def _save(key, entry, root=None):
    dev = select.device_of(None)
    path = tables.table_path(root or tables.user_root(), dev, "grouped")
    tables.write_entry(path, tables.header(dev, "grouped"), key, entry)
    return path


def _triton_entry(name, cfg):
    return {"candidate": name, "variant": "triton", "config": mconfig.GroupedConfig(**cfg).as_dict()
            if isinstance(cfg, dict) else cfg.as_dict()}


# ------------------------------------------------------------------------------------- keys
def test_problem_key_uses_the_layers_n_k_and_a_token_bucket():
    keys = {op: _key(op, *_operands(op)) for op in ("fwd", "dgrad", "wgrad")}
    assert keys["fwd"] == "op=fwd,dtype=fp16,G=4,N=24,K=32,M=32,tma=1"
    assert keys["dgrad"] == "op=dgrad,dtype=fp16,G=4,N=24,K=32,M=32,tma=1"   # same layer: same N, K
    assert keys["wgrad"] == "op=wgrad,dtype=fp16,G=4,N=24,K=32,M=32,tma=1"
    # 23 tokens and 17 share the bucket 32; the routing is no part of the key
    assert _key("fwd", *_operands("fwd", sizes=[17, 0, 0, 0])) == keys["fwd"]
    assert _key("fwd", *_operands("fwd", sizes=[40, 0, 0, 0])).endswith("M=64,tma=1")
    assert _key("fwd", *_operands("fwd", K=42, N=24)).endswith("tma=0")   # rows not 16-byte aligned
    assert [mselect.bucket(m) for m in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    shape = mselect.shape_of({"op": "dgrad", "G": 4, "N": 24, "K": 32, "M": 23, "dtype": "float16"})
    assert mselect.key_of(shape) == keys["dgrad"]


def test_cold_rule_is_todays_default_path(monkeypatch):
    a, b, s = _operands("fwd")
    call = launch._call("fwd", a, b, s, None)
    cold = mselect.cold(call)
    # In the interpreter (and on any call the Gluon kernel does not take): the Triton config table.
    assert cold.variant == "triton" and cold.config == mconfig.pick_config("fwd", 24, 32, a.device)
    assert cold.name == "i16x16" and "grouped_mm" not in mselect.candidates(call)   # the library: a GPU only
    # A call as an sm_90 GPU would see it (meta tensors: nothing runs)
    monkeypatch.setattr(interpreter, "active", lambda: False)
    x = torch.empty(4096, 5760, dtype=torch.bfloat16, device="meta")
    w = torch.empty(4, 2880, 5760, dtype=torch.bfloat16, device="meta")
    sz = torch.empty(4, dtype=torch.int32, device="meta")
    gpu = mselect.Call("dgrad", x, w, sz, None, 4096, 5760, 2880, 4, True, True, True, sm90=True)
    c = mselect.cold(gpu)
    assert (c.variant, c.name, c.config) == ("gluon", "ws_s5", mconfig.pick_ws_config("dgrad", 2880, 5760))
    assert list(mselect.candidates(gpu))[:2] == [mselect.LIBRARY, "ws_s5"]    # the library right after the cold pick
    other = dataclasses.replace(gpu, sm90=False, ws_ok=False)                   # another GPU: no library candidate
    assert mselect.LIBRARY not in mselect.candidates(other)
    wg = mselect.cold(mselect.Call("wgrad", x, torch.empty(4096, 7168, dtype=torch.bfloat16, device="meta"), sz,
                                   None, 4096, 7168, 5760, 4, True, True, False))
    assert wg.variant == "triton" and wg.config == mconfig.pick_config("wgrad", 7168, 5760, x.device)
    assert wg.name == "t128x256_s3" and "ws_s5" not in mselect.candidates(
        mselect.Call("wgrad", x, x, sz, None, 4096, 7168, 5760, 4, True, True, False))


def test_every_candidate_round_trips_through_a_table_entry():
    fam = mselect.Family(call=None)
    every = {**mconfig.WS_CANDIDATES, **mconfig.TRITON_CANDIDATES, **mconfig.INTERPRET_CANDIDATES}
    for name, cfg in every.items():
        variant = "gluon" if isinstance(cfg, mconfig.GroupedWsConfig) else "triton"
        entry = json.loads(json.dumps(fam.to_entry(select.Candidate(name, variant, cfg))))
        assert fam.from_entry(entry, {}) == select.Candidate(name, variant, cfg)
    lib = fam.to_entry(select.Candidate("grouped_mm", "library", mconfig.LibraryConfig()))
    assert lib["config"] == {} and fam.from_entry(lib, {}).config == mconfig.LibraryConfig()


# ------------------------------------------------------------------------- tables, on calls
@interpreted
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_table_entry_is_served_and_runs_correctly(op):
    a, b, s = _operands(op, seed=3)
    _save(_key(op, a, b, s), _triton_entry("i32x16", mconfig.INTERPRET_CANDIDATES["i32x16"]))
    p = _plan(op, a, b, s)
    assert p.choice.source == "table" and p.choice.candidate.name == "i32x16" and "user table" in p.choice.where
    assert p.meta["BLOCK_M"] == 32
    _run(op, a, b, s)


@interpreted
@pytest.mark.parametrize("entry, why", [
    ({"candidate": "x", "variant": "triton", "config": {"BLOCK_M": 24}}, "BLOCK_M=24"),
    ({"candidate": "x", "variant": "triton", "config": {"BLOCK_Q": 16}}, "unknown config field"),
    ({"candidate": "ws", "variant": "gluon", "config": {}}, "Gluon kernel does not take"),
    ({"candidate": "grouped_mm", "variant": "library", "config": {}}, "runs on a CUDA GPU"),
    ({"candidate": "x", "variant": "magic", "config": {}}, "unknown grouped variant"),
])
def test_an_entry_that_cannot_run_is_refused_and_the_cold_rule_serves(entry, why):
    a, b, s = _operands("fwd", seed=4)
    _save(_key("fwd", a, b, s), entry)
    with pytest.warns(tables.TuningTableWarning, match=why):
        p = _plan("fwd", a, b, s)
    assert p.choice.source == "cold" and p.choice.candidate.name == "i16x16"
    _run("fwd", a, b, s)


@interpreted
def test_explicit_configs_run_as_before_and_never_select():
    a, b, s = _operands("fwd", seed=5)
    _save(_key("fwd", a, b, s), _triton_entry("i32x16", mconfig.INTERPRET_CANDIDATES["i32x16"]))
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1, EPI_SUBTILE=False,
               FLATTEN=True, USE_TMA=False)
    p = _plan("fwd", a, b, s, config=cfg, tune=True)
    assert p.choice is None and p.label == mconfig.GroupedConfig(**cfg).label()
    _run("fwd", a, b, s, config=cfg, tune=True)
    saved = tables.read(tables.table_path(tables.user_root(), select.device_of(None), "grouped"))
    assert list(saved) == [_key("fwd", a, b, s)]   # nothing tuned


# ---------------------------------------------------------------------------- tune-on-miss
def _fake_gpu_timer(times, seen, monkeypatch=None):
    """A timer from a table (the candidate's name -> us); the interpreter's runs are slow,
    so the budget is raised for every candidate to be timed."""
    if monkeypatch is not None:
        monkeypatch.setenv("WORKBENCH_TUNE_BUDGET_S", "60")

    def timer(fn, rep_ms):
        fn()
        seen.append(fn.name)
        return times[fn.name], 0.01, "fake"
    return timer


@interpreted
@pytest.mark.parametrize("op", ["fwd", "wgrad"])
def test_tune_on_miss_times_every_candidate_keeps_the_fastest_and_saves_it(op, monkeypatch):
    seen = []
    monkeypatch.setattr(tune, "gpu_timer", _fake_gpu_timer({"i16x16": 50.0, "i32x16": 40.0, "i16x16_tma": 20.0},
                                                           seen, monkeypatch))
    a, b, s = _operands(op, seed=6)
    out = _run(op, a, b, s, tune=True)
    assert seen == ["i16x16", "i32x16", "i16x16_tma"]    # the cold candidate first
    p = _plan(op, a, b, s, tune=True)
    assert p.choice.source == "tuned" and p.choice.candidate.name == "i16x16_tma"
    entry = tables.read(tables.table_path(tables.user_root(), select.device_of(None), "grouped"))[_key(op, a, b, s)]
    assert entry["candidate"] == "i16x16_tma" and entry["kept"] and entry["us"] == 20.0 and entry["cold_us"] == 50.0
    assert entry["by"] == "tune-on-miss" and entry["config"]["USE_TMA"] is True
    # A later process (fresh plans and tables): served from the table, nothing timed, same result.
    launch.clear_plans()
    monkeypatch.setattr(select, "TABLES", tables.Tables())
    seen.clear()
    assert _plan(op, a, b, s, tune=True).choice.source == "table" and not seen
    again = _run(op, a, b, s)
    assert torch.equal(again, out)
    # WORKBENCH_TUNE=1 asks as tune=True does; tune=False wins over it.
    monkeypatch.setenv("WORKBENCH_TUNE", "1")
    assert select.tune_requested(None) and not select.tune_requested(False)


@interpreted
def test_tune_on_miss_keeps_the_cold_pick_within_the_margin(monkeypatch):
    seen = []
    monkeypatch.setattr(tune, "gpu_timer", _fake_gpu_timer({"i16x16": 50.0, "i32x16": 49.5, "i16x16_tma": 60.0},
                                                           seen, monkeypatch))
    a, b, s = _operands("dgrad", seed=7)
    _run("dgrad", a, b, s, tune=True)
    p = _plan("dgrad", a, b, s, tune=True)
    assert p.choice.candidate.name == "i16x16" and not p.choice.entry["kept"] and len(seen) == 3


@interpreted
def test_no_tuning_while_a_graph_is_captured(monkeypatch):
    seen = []
    monkeypatch.setattr(tune, "gpu_timer", _fake_gpu_timer({}, seen))
    monkeypatch.setattr(launch, "capturing", lambda t: True)    # as if a CUDA graph were being captured
    a, b, s = _operands("fwd", seed=8)
    p = _plan("fwd", a, b, s, tune=True)
    assert p.choice.source == "cold" and "captured" in p.choice.where and not seen
    _run("fwd", a, b, s, tune=True)
    assert not tables.table_path(tables.user_root(), select.device_of(None), "grouped").exists()


# ------------------------------------------------------------------- workbench tune grouped
def test_shape_rows_are_checked_and_say_what_is_wrong():
    ok = mselect.shape_of({"op": "wgrad", "G": 8, "N": 64, "K": 32, "M": 100, "routing": "balanced+extreme",
                           "model": "toy"})
    assert ok["routing"] == ["balanced", "extreme"] and ok["dtype"] == "bfloat16" and ok["model"] == "toy"
    assert mselect.shape_of({"op": "fwd", "G": 1, "N": 8, "K": 8, "M": 1})["routing"] == ["balanced"]
    for row, what in (({"op": "bwd", "G": 8, "N": 8, "K": 8, "M": 8}, "op must be one of fwd, dgrad, wgrad"),
                      ({"op": "fwd", "G": 0, "N": 8, "K": 8, "M": 8}, "G must be an integer from 1"),
                      ({"op": "fwd", "G": 8, "N": 8, "K": "8", "M": 8}, "K must be an integer"),
                      ({"op": "fwd", "G": 8, "N": 8, "K": 8, "M": 8, "routing": "skewed"},
                       "routing 'skewed' is not one of balanced, mild, extreme"),
                      ({"op": "fwd", "G": 8, "N": 8, "K": 8, "M": 8, "dtype": "int8"}, "dtype must be one of")):
        with pytest.raises(ValueError, match=what):
            mselect.shape_of(row)


def test_the_layer_spec_has_one_row_per_key():
    shapes = wtune.load_shapes(str(SPEC), mselect)
    keys = [mselect.key_of(s) for s in shapes]
    assert len(keys) == len(set(keys)) == 60
    assert {s["model"] for s in shapes} == {"DeepSeek-V3", "gpt-oss-20B", "Qwen3-30B-A3B", "Mixtral-8x7B"}
    assert {s["op"] for s in shapes} == {"fwd", "dgrad", "wgrad"}
    assert all(s["routing"] == ["balanced", "mild", "extreme"] and s["M"] == s["G"] * s["tokens_per_expert"]
               for s in shapes)


@interpreted
def test_workbench_tune_grouped_end_to_end(tmp_path, monkeypatch, capsys):
    """Two rows in the interpreter: progress, the best candidate across a row's routings
    (geometric mean), resume by key, --show."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("shapes:\n"
                    "  - {op: fwd, G: 3, N: 24, K: 16, M: 40, dtype: float16, routing: [balanced, extreme]}\n"
                    "  - {op: wgrad, G: 3, N: 24, K: 16, M: 40, dtype: float16}\n")
    # i32x16 is fastest on balanced routing but slow on extreme; i16x16_tma is better on both
    times = {("i16x16", "balanced"): 50.0, ("i16x16", "extreme"): 50.0,
             ("i32x16", "balanced"): 10.0, ("i32x16", "extreme"): 400.0,
             ("i16x16_tma", "balanced"): 40.0, ("i16x16_tma", "extreme"): 30.0}
    seen = []

    def timer(fn, rep_ms):
        seen.append(fn.name)
        return times[fn.name, fn.routing], 0.01, "fake"
    monkeypatch.setattr(tune, "gpu_timer", timer)
    monkeypatch.setattr(mselect, "_maker", _named_by_routing(mselect._maker))
    out = tmp_path / "tables"
    assert tune_command.main(["grouped", "--shapes", str(spec), "--out", str(out), "--budget-s", "5",
                       "--times", str(tmp_path / "times.csv")]) == 0
    err = capsys.readouterr()
    assert "tune grouped" in err.err and "2 to tune" in err.out
    dev = select.device_of(None)
    entries = tables.read(tables.table_path(out, dev, "grouped"))
    fwd = entries["op=fwd,dtype=fp16,G=3,N=24,K=16,M=64,tma=1"]
    assert fwd["candidate"] == "i16x16_tma" and fwd["routings"] == ["balanced", "extreme"]
    assert math.isclose(fwd["us"], math.sqrt(40.0 * 30.0), rel_tol=1e-3) and fwd["by"] == "workbench tune"
    assert fwd["us_by_routing"]["i16x16_tma"] == {"balanced": 40.0, "extreme": 30.0}
    assert "geometric mean over routings balanced/extreme" in fwd["how"]
    wgrad = entries["op=wgrad,dtype=fp16,G=3,N=24,K=16,M=64,tma=1"]
    assert wgrad["candidate"] == "i32x16" and wgrad["routings"] == ["balanced"]
    assert len((tmp_path / "times.csv").read_text().splitlines()) == 1 + 6
    # resume: both keys are in the table, nothing is timed again
    seen.clear()
    assert tune_command.main(["grouped", "--shapes", str(spec), "--out", str(out)]) == 0
    assert "2 already in" in capsys.readouterr().out and not seen
    # the entries serve grouped_gemm's calls of that key
    monkeypatch.setattr(tables, "SHIPPED_ROOT", out)
    monkeypatch.setattr(select, "TABLES", tables.Tables())
    a, w = mselect.operands({"op": "fwd", "G": 3, "N": 24, "K": 16, "M": 40, "dtype": "float16"}, "cpu")
    s = torch.tensor([10, 0, 30], dtype=torch.int32)
    p = launch.plan_for(a, w, s)
    assert p.choice.source == "table" and p.choice.candidate.name == "i16x16_tma" and "shipped" in p.choice.where
    _run("fwd", a, w, s)
    assert tune_command.main(["--show", "--out", str(out), "--device", dev["name"]]) == 0
    shown = capsys.readouterr().out
    assert "op=fwd,dtype=fp16,G=3,N=24,K=16,M=64,tma=1: i16x16_tma (triton)" in shown and "workbench tune" in shown


def _named_by_routing(real):
    """``_maker`` whose callables also carry the routing they run (the fake timer's table key)."""
    def maker(call, prepare):
        make = real(call, prepare)
        routing = "extreme" if int((call.sizes == 0).sum()) > 0 else "balanced"

        def wrapped(cand):
            fn = make(cand)
            fn.routing = routing
            return fn
        return wrapped
    return maker


@interpreted
def test_tune_shape_refuses_a_candidate_whose_results_disagree(monkeypatch):
    monkeypatch.setattr(tune, "gpu_timer", lambda fn, rep_ms: ({"i16x16": 50.0, "i32x16": 5.0, "i16x16_tma": 40.0}[
        fn.name], 0.01, "fake"))
    real = mselect._maker

    def lying(call, prepare):
        make = real(call, prepare)

        def wrapped(cand):
            fn = make(cand)
            if cand.name != "i32x16":
                return fn

            def wrong():
                return fn() * 1.5
            wrong.name = fn.name
            return wrong
        return wrapped
    monkeypatch.setattr(mselect, "_maker", lying)
    shape = mselect.shape_of({"op": "dgrad", "G": 3, "N": 24, "K": 16, "M": 40, "dtype": "float16"})
    key, entry, result = mselect.tune_shape(shape, budget=5)
    assert entry["candidate"] == "i16x16_tma" and "differs" in result.failed["i32x16"]
    assert key == mselect.key_of(shape)


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_shipped_grouped_tables_run_correctly(tmp_path, monkeypatch):
    """Every entry of this GPU's shipped grouped table is what grouped_gemm runs for its key
    (no user table in the way), and computes the right thing on balanced and extreme routing."""
    from kernels.moe import routing

    monkeypatch.setattr(tables, "SHIPPED_ROOT", Path(tables.__file__).parent / "tables")
    monkeypatch.setattr(select, "TABLES", tables.Tables())
    dev = select.device_of(torch.cuda.current_device())
    path = tables.table_path(tables.SHIPPED_ROOT, dev, "grouped")
    head = tables.header(dev, "grouped")
    entries = tables.read(path, {k: head[k] for k in ("device", "capability", "triton", "family")})
    if not entries:
        pytest.skip(f"no shipped grouped table for {dev['name']} ({path})")
    for key, entry in entries.items():
        f = dict(kv.split("=") for kv in key.split(","))
        if f["tma"] != "1":
            continue
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[f["dtype"]]
        shape = {"op": f["op"], "G": int(f["G"]), "N": int(f["N"]), "K": int(f["K"]), "M": int(f["M"]) // 2 + 1}
        shape["dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
        a, b = mselect.operands(shape, "cuda", seed=7)
        for kind in ("balanced", "extreme"):
            s = routing.make(kind, shape["M"], shape["G"], seed=11, device="cuda")
            op = shape["op"]
            if op == "wgrad":
                p = launch.plan_for_wgrad(a, b, s)
                out = torch.full((shape["G"], shape["K"], shape["N"]), float("nan"), device="cuda", dtype=dtype)
                moe.grouped_gemm_wgrad(a, b, s, out=out)
                ref = moe.reference_wgrad(a, b, s, dtype=torch.float32)
            else:
                p = launch.plan_for(a, b, s, trans_w=op == "dgrad")
                out = torch.full((shape["M"], shape["K"] if op == "dgrad" else shape["N"]), float("nan"),
                                 device="cuda", dtype=dtype)
                moe.grouped_gemm(a, b, s, trans_w=op == "dgrad", out=out)
                ref = moe.reference(a, b, s, trans_w=op == "dgrad", dtype=torch.float32)
            assert p.choice.source == "table" and p.choice.candidate.name == entry["candidate"], (key, p.choice)
            err = (out.float() - ref).norm() / ref.norm().clamp_min(1e-30)
            assert torch.isfinite(out).all() and float(err) < 1.5e-2, (key, kind, entry["candidate"], float(err))
            del out, ref
        del a, b
        torch.cuda.empty_cache()


@interpreted
def test_measure_script_runs_small_in_the_interpreter(tmp_path):
    """experiments/measure_grouped_gemm.py --small: one spec row shrunk, both routings, a CSV
    with provenance and a summary (its numbers are no performance: the interpreter)."""
    import importlib.util

    import pandas as pd

    spec = importlib.util.spec_from_file_location("measure_grouped_gemm", ROOT / "experiments" /
                                                  "measure_grouped_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--small", "--rows", "1", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / mod.CSV)
    assert list(df.routing) == ["balanced", "mild"] and set(df.op) == {"fwd"}
    assert (df.err_ours < 1.5e-2).all() and (df.ours_source == "cold").all() and df.prov_git_sha.notna().all()
    assert "geomean" in (tmp_path / "summary.md").read_text()
