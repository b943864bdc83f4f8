"""The selection layer (kernels.common.select / tables / tune) and the GEMM family through it:
tuning tables as untrusted files, tune-on-miss with a fake timer, the cold rule under graph
capture, and matmul choosing from a table (CPU, Triton's interpreter)."""
from __future__ import annotations

import json
import multiprocessing
import warnings
from pathlib import Path

import pytest
import torch

from kernels.common import select, tables, tune
from kernels.common.select import Candidate
from kernels.gemm import launch as glaunch, select as gselect, variants

DEVICE = {"name": "NVIDIA H200", "capability": "9.0"}


def _head(**over):
    return {**tables.header(DEVICE, "toy"), **over}


def _entry(name="b", variant="v", **knobs):
    return {"candidate": name, "variant": variant, "config": dict(knobs)}


@pytest.fixture(autouse=True)
def _fresh(isolated_tables):
    """Each test: tables of its own (conftest's isolated_tables) and no GEMM plans from before."""
    glaunch.clear_plans()
    yield
    glaunch.clear_plans()


def _write(root: Path, doc) -> Path:
    path = tables.table_path(root, DEVICE, "toy")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


# --------------------------------------------------------------------------------------- tables
def test_write_then_lookup_user_over_shipped(tmp_path):
    t = tables.Tables()
    shipped = tables.table_path(tables.SHIPPED_ROOT, DEVICE, "toy")
    tables.write_entry(shipped, _head(), "M=1", _entry("shipped"))
    assert t.lookup(DEVICE, "toy", "M=1")[0]["candidate"] == "shipped"
    assert t.save(DEVICE, "toy", "M=1", _entry("mine")) == tables.table_path(tables.user_root(), DEVICE, "toy")
    entry, where = t.lookup(DEVICE, "toy", "M=1")
    assert entry["candidate"] == "mine" and where.startswith("user table")
    assert t.lookup(DEVICE, "toy", "M=2") == (None, "")
    doc = json.loads(shipped.read_text())
    assert doc["device"] == "NVIDIA H200" and doc["capability"] == "9.0" and doc["family"] == "toy"
    assert tables.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


@pytest.mark.parametrize("what", ["corrupt", "truncated", "huge", "not-a-table", "old-version", "bad-entry"])
def test_bad_table_files_are_ignored_and_said_once(tmp_path, what, monkeypatch):
    good = {**_head(), "entries": {"M=1": _entry("a"), "M=2": _entry("b")}}
    text = json.dumps(good)
    doc = {"corrupt": "{not json at all", "truncated": text[: len(text) // 2],
           "huge": " " * (tables.MAX_TABLE_BYTES + 10) + text, "not-a-table": json.dumps([1, 2, 3]),
           "old-version": json.dumps({**good, "version": 99}),
           "bad-entry": json.dumps({**good, "entries": {"M=1": {"candidate": 3}, "M=2": _entry("b")}})}[what]
    _write(tables.user_root(), doc)
    t = tables.Tables()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        first = t.lookup(DEVICE, "toy", "M=2")
        t.lookup(DEVICE, "toy", "M=1")
        tables.Tables().lookup(DEVICE, "toy", "M=2")   # another reader in the same process: not said again
    said = [x for x in w if issubclass(x.category, tables.TuningTableWarning)]
    assert len(said) == 1, [str(x.message) for x in said]
    assert "toy.json" in str(said[0].message)
    if what == "bad-entry":   # the good entry of a partly bad file still serves
        assert first[0]["candidate"] == "b" and t.lookup(DEVICE, "toy", "M=1") == (None, "")
    else:
        assert first == (None, "")


def test_a_huge_table_is_read_bounded(monkeypatch):
    path = _write(tables.user_root(), "x")
    reads = []

    class Spy:
        def __init__(self, fh):
            self.fh = fh

        def read(self, n=-1):
            reads.append(n)
            return b" " * (tables.MAX_TABLE_BYTES + 1)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.fh.close()

    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: Spy(real_open(p, *a, **k)) if str(p) == str(path)
                        else real_open(p, *a, **k))
    with pytest.warns(tables.TuningTableWarning, match="larger than"):
        assert tables.read(path) == {}
    assert reads == [tables.MAX_TABLE_BYTES + 1]


@pytest.mark.parametrize("field,value", [("device", "NVIDIA H100 80GB HBM3"), ("triton", "3.5.0"),
                                         ("capability", "8.0")])
def test_a_table_of_another_device_or_triton_is_ignored(field, value):
    _write(tables.user_root(), {**_head(**{field: value}), "entries": {"M=1": _entry("a")}})
    with pytest.warns(tables.TuningTableWarning, match=f"made for {field}"):
        assert tables.Tables().lookup(DEVICE, "toy", "M=1") == (None, "")


def _writer(root: str, worker: int, n: int) -> None:
    for i in range(n):
        tables.write_entry(Path(root) / "t.json", _head(), f"w={worker},i={i}", _entry(f"c{worker}-{i}"))


def test_concurrent_writers_lose_no_entry(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 15)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    entries = tables.read(tmp_path / "t.json")
    assert len(entries) == 60 and all(entries[f"w={w},i={i}"]["candidate"] == f"c{w}-{i}"
                                      for w in range(4) for i in range(15))
    assert not list(tmp_path.glob("*.tmp"))


def test_an_unwritable_place_keeps_the_result_for_this_process(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("WORKBENCH_TUNING_DIR", str(blocker / "tuning"))   # under a file: cannot be made
    t = tables.Tables()
    with pytest.warns(tables.TuningTableWarning, match="could not be saved.*WORKBENCH_TUNING_DIR"):
        assert t.save(DEVICE, "toy", "M=1", _entry("x")) is None
    entry, where = t.lookup(DEVICE, "toy", "M=1")
    assert entry["candidate"] == "x" and "not saved" in where


# ---------------------------------------------------------------------------------------- tuner
def _fake_timer(times):
    def timer(fn, rep_ms):
        fn()
        return times[fn.name], 0.005, "fake"
    return timer


def _cands(*names):
    return [Candidate(n, "v", {}) for n in names]


def _make(c):
    def fn():
        return c.name
    fn.name = c.name
    return fn


def test_tuner_picks_the_fastest_and_keeps_the_cold_pick_within_the_margin():
    cands = _cands("cold", "a", "b")
    r = tune.tune(cands, cands[0], _make, timer=_fake_timer({"cold": 10.0, "a": 7.0, "b": 8.0}), budget=5)
    assert r.kept and r.candidate.name == "a" and set(r.times_us) == {"cold", "a", "b"}
    r = tune.tune(cands, cands[0], _make, timer=_fake_timer({"cold": 10.0, "a": 9.8, "b": 11.0}), budget=5)
    assert not r.kept and r.candidate.name == "cold"   # 2% faster is within the noise margin


def test_tuner_skips_failing_and_disagreeing_candidates():
    cands = _cands("cold", "broken", "wrong", "ok")

    def make(c):
        if c.name == "broken":
            raise ValueError("needs sm_90")
        return _make(c)

    r = tune.tune(cands, cands[0], make, agree=lambda ref, out: out != "wrong",
                  timer=_fake_timer({"cold": 10.0, "wrong": 1.0, "ok": 5.0}), budget=5)
    assert r.candidate.name == "ok" and set(r.failed) == {"broken", "wrong"}


def test_tuner_stops_starting_candidates_after_the_budget(monkeypatch):
    """Without compile estimates (families that give none): candidates start while the budget
    lasts; each timing takes 1 s of a fake clock, so a 3 s budget times three."""
    clock = {"t": 0.0}
    monkeypatch.setattr(tune.time, "monotonic", lambda: clock["t"])
    cands = _cands(*[f"c{i}" for i in range(10)])
    fake = _fake_timer({c.name: 10.0 - i for i, c in enumerate(cands)})

    def timer(fn, rep_ms):
        clock["t"] += 1.0
        return fake(fn, rep_ms)
    r = tune.tune(cands, cands[0], _make, timer=timer, budget=3)
    assert list(r.times_us) == ["c0", "c1", "c2"] and set(r.skipped) == {f"c{i}" for i in range(3, 10)}


def test_tuning_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORKBENCH_TUNE_BUDGET_S", "0.5")
    assert tune.budget_s() == 0.5
    monkeypatch.setenv("WORKBENCH_TUNE_BUDGET_S", "soon")
    with pytest.raises(ValueError, match="number of seconds"):
        tune.budget_s()


# ----------------------------------------------------------------------------- the choice itself
class Toy:
    name = "toy"

    def from_entry(self, entry, problem):
        if entry["config"].get("block") not in (16, 32):
            raise ValueError(f"block={entry['config'].get('block')!r} must be 16 or 32")
        return Candidate(entry["candidate"], entry["variant"], entry["config"])

    def to_entry(self, c):
        return {"candidate": c.name, "variant": c.variant, "config": dict(c.config)}


def _choose(tune_=False, capturing=False, result=None):
    calls = []

    def tuner(cold):
        calls.append(cold)
        return result
    cold = Candidate("cold", "v", {"block": 16})
    choice = select.choose(Toy(), {"M": 1}, DEVICE, cold=lambda: cold, tune=tune_, capturing=capturing,
                           tuner=tuner)
    return choice, calls


def test_no_tuning_while_a_graph_is_captured():
    choice, calls = _choose(tune_=True, capturing=True)
    assert choice.source == "cold" and "captured" in choice.where and not calls


def test_a_hand_edited_invalid_entry_is_refused_and_the_cold_rule_serves():
    _write(tables.user_root(), {**_head(), "entries": {"M=1": _entry("fast", block=7)}})
    with pytest.warns(tables.TuningTableWarning, match="block=7 must be 16 or 32"):
        choice, _ = _choose()
    assert choice.source == "cold" and choice.candidate.name == "cold"


def test_tuned_winner_is_saved_with_provenance_and_served_next():
    cands = [Candidate("cold", "v", {"block": 16}), Candidate("fast", "v", {"block": 32})]
    result = tune.tune(cands, cands[0], _make, timer=_fake_timer({"cold": 10.0, "fast": 5.0}), budget=5)
    choice, calls = _choose(tune_=True, result=result)
    assert choice.source == "tuned" and choice.candidate.name == "fast" and len(calls) == 1
    entry = tables.read(tables.table_path(tables.user_root(), DEVICE, "toy"))["M=1"]
    assert entry["us"] == 5.0 and entry["cold"] == "cold" and entry["cold_us"] == 10.0 and entry["kept"]
    assert {"date", "git", "torch", "how", "by"} <= set(entry) and entry["config"] == {"block": 32}
    select.TABLES = tables.Tables()   # a later process: served from the table, nothing timed
    again, calls = _choose(tune_=True)
    assert again.source == "table" and again.candidate.name == "fast" and not calls


# -------------------------------------------------------------------- the GEMM family through it
def _operands(M=33, N=40, K=48, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g).to(dtype), torch.randn(K, N, generator=g).to(dtype))


def _reference_ok(c, a, b):
    ref = a.double() @ b.double()
    err = torch.linalg.vector_norm(c.double() - ref) / torch.linalg.vector_norm(ref)
    return bool(torch.isfinite(c).all()) and float(err) < 5e-3


def test_gemm_table_entry_runs_and_says_where_it_came_from():
    a, b = _operands()
    call = glaunch._call(a, b, None, 33, 40, 48, False, False)
    key = select.problem_key(gselect.problem(call))
    assert key == "dtype=fp16,M=33,N=40,K=48,b=row,tma=111"
    knobs = dict(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1, num_sms=3)
    dev = select.device_of(None)
    tables.write_entry(tables.table_path(tables.user_root(), dev, "gemm"), tables.header(dev, "gemm"), key,
                       {"candidate": "tiny", "variant": "persistent", "config": knobs})
    p = glaunch.plan_for(a, b)
    assert p.choice.source == "table" and p.choice.candidate.name == "tiny" and p.config.block_m == 16
    c = torch.full((33, 40), float("nan"), dtype=torch.float16)
    glaunch.matmul(a, b, out=c)
    assert _reference_ok(c, a, b)


def test_gemm_invalid_table_config_falls_back_to_the_cold_rule():
    a, b = _operands()
    call = glaunch._call(a, b, None, 33, 40, 48, False, False)
    key = select.problem_key(gselect.problem(call))
    dev = select.device_of(None)
    path = tables.table_path(tables.user_root(), dev, "gemm")
    tables.write_entry(path, tables.header(dev, "gemm"), key,
                       {"candidate": "x", "variant": "persistent", "config": {"block_m": 24}})
    with pytest.warns(tables.TuningTableWarning, match="block_m=24"):
        p = glaunch.plan_for(a, b)
    assert p.choice.source == "cold"
    assert _reference_ok(glaunch.matmul(a, b), a, b)


def test_gemm_tune_on_miss_times_candidates_saves_the_winner_and_results_agree(monkeypatch):
    tiny = variants.persistent.Config(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
    split = variants.splitk.Config(block_m=16, block_n=32, block_k=16, num_warps=1, num_stages=1, split_k=2)
    monkeypatch.setattr(gselect, "candidates", lambda call: {
        "tiny": Candidate("tiny", "persistent", tiny), "split": Candidate("split", "splitk", split)})
    times = {"cold": 50.0, "tiny": 40.0, "split": 20.0}
    seen = []
    # the interpreter's runs take real time, which the budget counts: a budget they never reach
    monkeypatch.setenv("WORKBENCH_TUNE_BUDGET_S", "600")

    def timer(fn, rep_ms):
        fn()
        name = ["cold", "split", "tiny"][len(seen)]   # cheapest compile first: split-K before the pointer kernel
        seen.append(name)
        return times[name], 0.01, "fake"
    monkeypatch.setattr(tune, "gpu_timer", timer)
    a, b = _operands(M=20, N=24, K=64)
    c = torch.full((20, 24), float("nan"), dtype=torch.float16)
    glaunch.matmul(a, b, out=c, tune=True)
    assert _reference_ok(c, a, b) and seen == ["cold", "split", "tiny"]
    p = glaunch.plan_for(a, b, out=c, tune=True)
    assert p.choice.source == "tuned" and p.kind == "splitk"
    entry = next(iter(tables.read(tables.table_path(tables.user_root(), select.device_of(None), "gemm")).values()))
    assert entry["candidate"] == "split" and entry["variant"] == "splitk" and entry["config"]["split_k"] == 2
    # A later process (fresh plans) serves it from the table, tuning nothing.
    glaunch.clear_plans()
    monkeypatch.setattr(select, "TABLES", tables.Tables())
    seen.clear()
    assert glaunch.plan_for(a, b, out=c, tune=True).choice.source == "table" and not seen
    # Without tune the table still serves; WORKBENCH_TUNE=1 asks as tune=True does.
    assert glaunch.plan_for(a, b, out=c).choice.source == "table"
    monkeypatch.setenv("WORKBENCH_TUNE", "1")
    assert select.tune_requested(None) and not select.tune_requested(False)


def test_gemm_library_candidate_is_refused_off_the_gpu():
    a, b = _operands()
    with pytest.raises(ValueError, match="CUDA GPU"):
        glaunch.matmul(a, b, variants.library.Config())


def test_every_variant_config_round_trips_through_a_table_entry():
    for name, mod in variants.VARIANTS.items():
        cfg = mod.Config()
        fam = gselect.Family(call=None)
        entry = fam.to_entry(Candidate("c", name, cfg))
        json.dumps(entry)
        back_mod, back = variants.from_dict(entry["variant"], entry["config"])
        assert back_mod is mod and back == cfg
    with pytest.raises(ValueError, match="no knob"):
        variants.from_dict("splitk", {"stream_k": True})
    with pytest.raises(ValueError, match="unknown gemm variant"):
        variants.from_dict("magic", {})


@pytest.mark.gpu
def test_gpu_shipped_tables_load_and_their_configs_run_correctly():
    """Every entry of this GPU's shipped GEMM table (zoo shapes) plans and runs within tolerance."""
    dev = select.device_of(torch.cuda.current_device())
    path = tables.table_path(Path(tables.__file__).parent / "tables", dev, "gemm")
    entries = tables.read(path, {k: v for k, v in tables.header(dev, "gemm").items()
                                 if k in ("device", "capability", "triton", "family")})
    if not entries:
        pytest.skip(f"no shipped GEMM table for {dev['name']} ({path})")
    checked = 0
    for key, entry in list(entries.items())[:40]:
        f = dict(kv.split("=") for kv in key.split(","))
        if f["b"] != "row" or f["tma"] != "111":
            continue
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[f["dtype"]]
        M, N, K = int(f["M"]), int(f["N"]), int(f["K"])
        a = torch.randn(M, K, device="cuda").to(dtype)
        b = torch.randn(K, N, device="cuda").to(dtype)
        c = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        mod, cfg = variants.from_dict(entry["variant"], entry["config"])
        glaunch.matmul(a, b, cfg, out=c)
        ref = a.float() @ b.float()
        err = torch.linalg.vector_norm(c.float() - ref) / torch.linalg.vector_norm(ref)
        assert torch.isfinite(c).all() and float(err) < 2e-2, (key, entry["candidate"], float(err))
        checked += 1
    assert checked > 0


def test_workbench_tune_does_not_count_compiles_against_the_budget(monkeypatch):
    """A first run (the compile) takes 10 s of the fake clock, a timing 1 s: with a 5 s budget a
    user's first call stops after the compiles eat it; ``workbench tune`` times every candidate."""
    clock = {"t": 0.0}
    monkeypatch.setattr(tune.time, "monotonic", lambda: clock["t"])
    cands = _cands("cold", "a", "b", "c")

    def make(c):
        state = {"first": True}

        def fn():
            if state["first"]:
                clock["t"] += 10.0
                state["first"] = False
            return c.name
        fn.name = c.name
        return fn

    def timer(fn, rep_ms):
        clock["t"] += 1.0
        return {"cold": 9.0, "a": 8.0, "b": 7.0, "c": 1.0}[fn.name], 0.0, "fake"

    user = tune.tune(cands, cands[0], make, timer=timer, budget=5)
    assert len(user.times_us) == 1 and user.candidate.name == "cold"
    whole = tune.tune(cands, cands[0], make, timer=timer, budget=5, count_first_runs=False)
    assert set(whole.times_us) == {"cold", "a", "b", "c"} and whole.candidate.name == "c"


# ----------------------------------------------------------- tune-on-miss: compiles within the budget
class _FakeTriton:
    """A fake clock and a fake compiler: a candidate's first run costs its kind's compile time
    (once per kernel: a second candidate of the same kernel costs nothing), each timing ``timing_s``."""

    def __init__(self, monkeypatch, compile_s: dict, timing_s: float = 0.05):
        self.t, self.compile_s, self.timing_s, self.cache = 0.0, compile_s, timing_s, set()
        monkeypatch.setattr(tune.time, "monotonic", lambda: self.t)

    def make(self, c):
        def fn():
            if (c.variant, c.config.get("kernel", c.name)) not in self.cache:
                self.cache.add((c.variant, c.config.get("kernel", c.name)))
                self.t += self.compile_s[c.variant]
            return c.name
        fn.name = c.name
        return fn

    def timer(self, fn, rep_ms):
        self.t += self.timing_s
        return {"cold": 10.0, "lib": 9.0}.get(fn.name, 5.0), 0.0, "fake"


def _kinds(*spec):
    """Candidates (name, kind): the kind is the variant (what CompileCosts keys on here)."""
    return [Candidate(n, k, {}) for n, k in spec]


def _compiles(costs):
    return tune.Compiles(costs, kind=lambda c: c.variant, key=lambda c: (c.variant, c.config.get("kernel", c.name)))


def test_tune_on_miss_holds_its_budget_with_compiles_counted(monkeypatch):
    """Budget 2 s, compiles 0.7 s (plain tiles) and 1.5 s (stream-K): a tuner that only stops
    *starting* candidates once the budget is spent starts a compile at 1.5 s and returns at
    2.25 s, past budget + 10%; counting expected compiles it returns within 2.2 s, having timed
    cuBLAS (nothing to compile) and the plain tiles before the stream-K ones."""
    spec = [("cold", "tma"), ("sk1", "sk"), ("lib", "library"), ("a", "tma"), ("b", "tma"), ("sk2", "sk")]
    costs = {"tma": 0.7, "sk": 1.5, "library": 0.0}
    fake = _FakeTriton(monkeypatch, costs)
    cands = _kinds(*spec)
    guesses = tune.CompileCosts({"tma": 0.8, "sk": 2.0, "library": 0.0}, default_s=1.0)
    r = tune.tune(cands, cands[0], fake.make, timer=fake.timer, budget=2.0, compiles=_compiles(guesses))
    assert fake.t <= 2.0 * 1.1 and r.elapsed_s <= 2.2
    assert list(r.times_us) == ["cold", "lib", "a"]   # compiled (nothing to compile) first, then the cheapest
    assert set(r.skipped) == {"b", "sk1", "sk2"} and "budget" in r.skipped["b"]
    assert r.first_run_s["cold"] == pytest.approx(0.7) and guesses.measured_s["tma"] == pytest.approx(0.7)
    # The same problem with compile time ignored overruns: this test could not pass without it.
    fake2 = _FakeTriton(monkeypatch, costs)
    blind = tune.tune(cands, cands[0], fake2.make, timer=fake2.timer, budget=2.0)
    assert fake2.t > 2.0 * 1.1 and blind.elapsed_s > 2.2


def test_compile_estimates_follow_what_is_measured(monkeypatch):
    """The guess for a kind (0.1 s) is far below its real compile (0.8 s): after the first one is
    measured, the estimate is 0.8 and the third is not started (a guess that stayed would start
    it at 1.8 s and return at 2.65 s)."""
    fake = _FakeTriton(monkeypatch, {"x": 0.8})
    cands = _kinds(("cold", "x"), ("a", "x"), ("b", "x"), ("c", "x"))
    costs = tune.CompileCosts({"x": 0.1}, default_s=0.1)
    r = tune.tune(cands, cands[0], fake.make, timer=fake.timer, budget=2.0, compiles=_compiles(costs))
    assert list(r.times_us) == ["cold", "a"] and set(r.skipped) == {"b", "c"} and fake.t <= 2.2
    # A kernel already compiled costs nothing more, and a load from Triton's cache (a first run
    # under cache_hit_s) leaves the kind's estimate as it was.
    assert costs.estimate("x", ("x", "a")) == 0.0 and costs.estimate("x", ("x", "new")) == pytest.approx(0.8)
    costs.observe("x", ("x", "loaded"), 0.02)
    assert costs.estimate("x", ("x", "new")) == pytest.approx(0.8) and costs.estimate("x", ("x", "loaded")) == 0.0


def test_the_first_compile_of_a_process_costs_more_and_the_budget_holds(monkeypatch):
    """cuBLAS cold (nothing to compile, timing 0.35 s of a 4 ms kernel), then a plain tile whose
    compile (0.8 s, its guess) is this process's first and costs 1.0 s more (an H200 node's first
    compile, experiments/probes/probe_compile_costs.py): with the first compile's extra counted the
    tile is not started and the call returns within the budget; counted without it, it overruns
    2.2 s (the H200's first call that tuned took 2.21 s of a 2 s budget)."""
    class First(_FakeTriton):
        def make(self, c):
            inner = super().make(c)

            def fn():
                if c.variant != "library" and not self.compiled_once:
                    self.compiled_once = True
                    self.t += 1.0
                return inner()
            fn.name = c.name
            return fn

    for extra, within in ((1.0, True), (0.0, False)):
        fake = First(monkeypatch, {"tma": 0.8, "library": 0.0}, timing_s=0.35)
        fake.compiled_once = False
        cands = _kinds(("cold", "library"), ("a", "tma"), ("b", "tma"))
        costs = tune.CompileCosts({"tma": 0.8, "library": 0.0}, default_s=1.0, first_extra_s=extra)
        r = tune.tune(cands, cands[0], fake.make, timer=fake.timer, budget=2.0, compiles=_compiles(costs))
        assert (fake.t <= 2.0 * 1.1) == within, (extra, fake.t)
        if within:
            assert list(r.times_us) == ["cold"] and set(r.skipped) == {"a", "b"}
    # once a compile is measured (not a library's first run), the extra is gone from the estimates
    costs = tune.CompileCosts({"tma": 0.8, "library": 0.0}, default_s=1.0, first_extra_s=1.0)
    assert costs.estimate("tma", "k") == pytest.approx(1.8) and costs.estimate("library", "l") == 0.0
    costs.observe("library", "l0", 0.12)   # cuBLAS setting itself up is not a compile
    assert costs.estimate("tma", "k") == pytest.approx(1.8)
    costs.observe("tma", "k0", 0.9)
    assert costs.estimate("tma", "k") == pytest.approx(0.9)


def test_candidates_of_a_compiled_kernel_are_timed_first(monkeypatch):
    """Two candidates sharing the cold candidate's kernel (another knob that compiles to the same
    kernel) cost no compile: they come first and fit where a new kernel would not."""
    fake = _FakeTriton(monkeypatch, {"tma": 0.9})
    cands = [Candidate("cold", "tma", {"kernel": "k0"}), Candidate("new", "tma", {"kernel": "k1"}),
             Candidate("same", "tma", {"kernel": "k0"})]
    costs = tune.CompileCosts({"tma": 0.9}, default_s=0.9)
    costs.compiled.add(("tma", "k0"))   # compiled earlier in this process (fake Triton has it too)
    fake.cache.add(("tma", "k0"))
    r = tune.tune(cands, cands[0], fake.make, timer=fake.timer, budget=0.5, compiles=_compiles(costs))
    assert list(r.times_us) == ["cold", "same"] and set(r.skipped) == {"new"} and fake.t <= 0.55


def test_gemm_tune_on_miss_counts_compiles_against_the_budget(monkeypatch):
    """matmul(tune=True) in the interpreter with a fake clock and fake compile times per kind of
    kernel (the pointer kernel 0.7 s, split-K 1.5 s; timing 0.05 s): the first call tunes within
    budget + 10%, times the candidates whose compiles fit, says which it skipped, and learns the
    pointer kernel's real compile cost; with compiles ignored the same call overruns."""
    tiny = variants.persistent.Config(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
    tiny2 = variants.persistent.Config(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1)
    split = variants.splitk.Config(block_m=16, block_n=32, block_k=16, num_warps=1, num_stages=1, split_k=2)
    monkeypatch.setattr(gselect, "candidates", lambda call: {
        "tiny": Candidate("tiny", "persistent", tiny), "tiny2": Candidate("tiny2", "persistent", tiny2),
        "split": Candidate("split", "splitk", split)})
    compile_s = {"ptr": 0.7, "splitk": 1.5}
    clock = {"t": 0.0}
    seen = set()
    monkeypatch.setattr(tune.time, "monotonic", lambda: clock["t"])
    real_execute = variants.execute

    def execute(p, a, b, out):   # the fake compiler: a kernel's first launch costs its kind's compile
        key = (p.kind, repr(sorted(p.launch.kwargs.items())))
        if key not in seen:
            seen.add(key)
            clock["t"] += compile_s[p.kind]
        return real_execute(p, a, b, out)
    monkeypatch.setattr(variants, "execute", execute)

    def timer(fn, rep_ms):
        fn()
        clock["t"] += 0.05
        return 10.0, 0.0, "fake"
    monkeypatch.setattr(tune, "gpu_timer", timer)
    # guesses near the fake's compiles (this test is of the mechanism, not of the node's values)
    costs = tune.CompileCosts(dict(gselect.COMPILE_GUESS_S, ptr=0.6, splitk=0.9), default_s=1.5)
    monkeypatch.setattr(gselect, "COMPILE_COSTS", costs)
    a, b = _operands(M=20, N=24, K=64)
    c = torch.full((20, 24), float("nan"), dtype=torch.float16)
    glaunch.matmul(a, b, out=c, tune=True)
    assert _reference_ok(c, a, b)
    entry = glaunch.plan_for(a, b, out=c, tune=True).choice.entry
    assert entry["elapsed_s"] <= 2.0 * 1.1 and clock["t"] <= 2.0 * 1.1
    assert entry["timed"] == 2 and entry["skipped"] == 2 and entry["first_runs_s"] == pytest.approx(1.4)
    assert costs.measured_s["ptr"] == pytest.approx(0.7)
    # compiles ignored (the tuner as it was): the same first call passes budget + 10%
    glaunch.clear_plans()
    monkeypatch.setattr(gselect, "compiles", lambda call: None)
    monkeypatch.setattr(select, "TABLES", tables.Tables(shipped=Path(tables.user_root()) / "none"))
    tables.table_path(tables.user_root(), select.device_of(None), "gemm").unlink()
    seen.clear()
    clock["t"] = 0.0
    glaunch.matmul(a, b, out=c, tune=True)
    assert glaunch.plan_for(a, b, out=c, tune=True).choice.entry["elapsed_s"] > 2.0 * 1.1
