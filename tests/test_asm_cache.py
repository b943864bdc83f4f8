"""The inspector on real cache entries: cross-compiled fixtures and one from an H200."""
import json
import os
import shutil
from pathlib import Path

import pytest

from workbench.asm import cache as cache_mod
from workbench.asm.cache import CacheError, get_entry, group_entries, list_entries, select
from workbench.asm.diff import diff_entries

FIXTURES = Path(__file__).parent / "fixtures"
CROSS = FIXTURES / "cache"
H200 = FIXTURES / "h200_cache"


def _hint(entry) -> bool:
    return json.loads((entry.path / f"{entry.name}.workbench.json").read_text())["constexprs"]["HINT"]


def _global_stores(mix):
    stores = mix[(mix["space"] == "global") & (mix["kind"] == "store")]
    return {int(w): int(c) for w, c in zip(stores["width_bits"], stores["count"])}, float(stores["bytes_per_thread"].sum())


@pytest.fixture
def cache(tmp_path):
    """A private copy of the cross-compiled fixtures, safe to damage."""
    dst = tmp_path / "cache"
    shutil.copytree(CROSS, dst)
    return dst


def test_lists_every_fixture_entry_healthy():
    entries = list_entries(CROSS)
    assert len(entries) == 6
    assert {e.arch for e in entries} == {"sm90", "gfx942", "gfx950"}
    for e in entries:
        assert e.ok, e.problems
        assert e.name == "remote_store_kernel"
        assert e.num_warps == 4 and e.triton_version == "3.6.0"
        assert {"source", "ttir", "ttgir", "llir"} <= set(e.stages)
        assert ("ptx" in e.stages) == (e.backend == "cuda")
        assert ("amdgcn" in e.stages) == (e.backend == "hip")


def test_listing_reads_no_assembly(monkeypatch):
    opened = []
    real_read_bytes = cache_mod.reading.read_bytes  # every read of the cache goes through it

    def spy(path, *a, **k):
        opened.append(Path(path).suffix)
        return real_read_bytes(path, *a, **k)

    monkeypatch.setattr(cache_mod.reading, "read_bytes", spy)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: pytest.fail(f"unbounded read of {self}"))
    monkeypatch.setattr("builtins.open", lambda *a, **k: pytest.fail(f"listing opened {a[0]}"))
    rows = [e.summary() for e in list_entries(CROSS)]
    assert rows and set(opened) == {".json"}


@pytest.mark.parametrize("arch", ["sm90", "gfx942", "gfx950"])
def test_hint_turns_16_bit_stores_into_128_bit(arch):
    """The iris translate pattern: scalar stores without hints, vector stores with them."""
    entries = select(list_entries(CROSS), name="remote_store_kernel", arch=arch)
    by_hint = {_hint(e): e for e in entries}
    (plain, plain_bytes), (hinted, hinted_bytes) = (_global_stores(by_hint[h].mix()) for h in (False, True))
    if arch == "sm90":
        assert plain == {16: 16} and hinted == {128: 2}
    else:
        assert plain == {16: 8} and hinted == {128: 1}
    assert plain_bytes == hinted_bytes  # same data, fewer and wider instructions


def test_sass_from_cross_compiled_cubin():
    entries = select(list_entries(CROSS), arch="sm90")
    by_hint = {_hint(e): e for e in entries}
    assert _global_stores(by_hint[False].mix("sass"))[0] == {16: 16}
    assert _global_stores(by_hint[True].mix("sass"))[0] == {128: 2}
    assert "STG.E.128" in by_hint[True].text("sass")


def test_h200_entry_matches_the_device_disassembly():
    entries = list_entries(H200)
    assert len(entries) == 2 and all(e.ok and e.arch == "sm90" for e in entries)
    for e in entries:
        ours = e.text("sass")
        theirs = (H200 / f"{e.hash}.cuobjdump_sass").read_text()
        assert [ln.split("*/")[1].strip() for ln in ours.splitlines() if "STG" in ln] == \
               [ln.split("*/")[1].strip() for ln in theirs.splitlines() if "STG" in ln]
        stores, nbytes = _global_stores(e.mix("sass"))
        assert stores in ({16: 16}, {128: 2}) and nbytes == 32.0
        ptx_stores, _ = _global_stores(e.mix("ptx"))
        assert ptx_stores == stores


def test_h200_resources_agree_with_cuobjdump():
    for e in list_entries(H200):
        res = e.resources()
        device = (H200 / f"{e.hash}.cuobjdump_res").read_text()
        assert f"REG:{res['registers']} " in device


def test_groups_show_what_differs():
    groups = group_entries(list_entries(CROSS))
    assert len(groups) == 1
    diff = groups[0].differences()
    assert sorted(set(diff["constexprs"]["HINT"])) == [False, True]
    assert set(diff["target"]["arch"]) == {"sm90", "gfx942", "gfx950"}
    assert "BLOCK" not in diff.get("constexprs", {})  # the same in every entry


def test_diff_reports_mix_delta_and_changed_lines():
    entries = select(list_entries(CROSS), arch="sm90")
    by_hint = {_hint(e): e for e in entries}
    d = diff_entries(by_hint[False], by_hint[True], "ptx")
    stores = d.mix[(d.mix["space"] == "global") & (d.mix["kind"] == "store")]
    delta = {int(w): (a, b) for w, a, b in zip(stores["width_bits"], stores["count_a"], stores["count_b"])}
    assert delta == {16: (16, 0), 128: (0, 2)}
    assert d.changed_lines > 0
    assert any("st.global.v4.b32" in r.b for r in d.rows if r.tag != "equal")
    # Without the hint the stores went through a shared-memory layout conversion.
    assert d.metadata == {"shared": (4096, 0)}


def test_select_by_hash_prefix_path_and_name():
    e = list_entries(CROSS)[0]
    assert get_entry(e.hash[:8], CROSS).path == e.path
    assert get_entry(e.hash[:8].lower(), CROSS).path == e.path
    assert get_entry(str(e.path)).hash == e.hash
    assert len(select(list_entries(CROSS), name="remote_store_kernel", backend="hip")) == 4
    assert select(list_entries(CROSS), name="nope") == []


def test_ambiguous_and_unknown_prefixes(cache):
    (cache / "ABCDEF1").mkdir()
    (cache / "ABCDEF2").mkdir()
    with pytest.raises(CacheError, match="ambiguous"):
        get_entry("ABCDEF", cache)
    with pytest.raises(CacheError, match="no entry with hash prefix"):
        get_entry("ZZZZZZZZ", cache)


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert cache_mod.cache_dir() == tmp_path
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(CacheError, match=r"\.triton/cache"):
        cache_mod.cache_dir()
    assert cache_mod.cache_dir(CROSS) == CROSS


def _damage(cache: Path):
    """Every kind of bad entry the inspector must report without stopping."""
    entries = sorted(p for p in cache.iterdir())
    name = "remote_store_kernel"
    bad = {}
    half = cache / "tmp.pid_4242_123"
    shutil.copytree(entries[0], half)
    bad["half-written"] = half
    (entries[1] / f"__grp__{name}.json").unlink()
    bad["no __grp__"] = entries[1]
    (entries[2] / f"{name}.json").write_text('{"hash": "abc", "target": ')
    bad["unreadable"] = entries[2]
    (entries[3] / f"{name}.llir").unlink()
    bad["missing"] = entries[3]
    stray = cache / "not_an_entry"
    stray.mkdir()
    (stray / "notes.txt").write_text("hello")
    bad["not a Triton kernel entry"] = stray
    (cache / "empty").mkdir()
    bad["empty directory"] = cache / "empty"
    (entries[4] / f"{name}.json").write_bytes(b"\x00\xff\xfe garbage")
    bad["unreadable "] = entries[4]
    return bad


def test_bad_entries_are_reported_and_listing_goes_on(cache):
    bad = _damage(cache)
    entries = {e.path: e for e in list_entries(cache)}
    assert len(entries) == 6 + 3  # every directory is listed, healthy or not
    for word, path in bad.items():
        problems = " ".join(entries[path].problems)
        assert word.strip() in problems, (word, problems)
        assert any(verb in problems for verb in ("delete", "re-compile", "leave it")), problems
    healthy = [e for e in entries.values() if e.ok]
    assert len(healthy) == 2 and all(len(e.mix()) for e in healthy)


def test_truncated_assembly_is_counted_as_far_as_it_goes(cache):
    e = select(list_entries(cache), arch="sm90")[0]
    ptx = e.stages["ptx"]
    text = ptx.read_text()
    ptx.write_text(text[: len(text) * 2 // 3])
    e = get_entry(str(e.path))
    mix = e.mix()
    assert mix["count"].sum() > 0
    assert any("truncated" in p for p in e.problems)


def test_missing_stage_and_unknown_stage(cache):
    e = select(list_entries(cache), arch="gfx942")[0]
    with pytest.raises(CacheError, match="no ptx stage"):
        e.text("ptx")
    with pytest.raises(CacheError, match="unknown stage"):
        e.text("hip-asm")
    with pytest.raises(CacheError, match="no cubin stage"):
        e.text("sass")


def test_python_source_found_through_ir_location():
    e = list_entries(CROSS)[0]
    # The fixture was compiled elsewhere: the path may not exist here, but the repo copy does.
    src = e.text("python")
    assert src.lstrip().startswith("@triton.jit") and "def remote_store_kernel" in src
    assert "tl.store(dst, x, mask=mask)" in src


def test_nothing_is_written_into_the_cache(cache):
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    for e in list_entries(cache):
        e.mix()
        e.resources()
        e.text("ttgir")
    group_entries(list_entries(cache))
    after = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    assert before == after
