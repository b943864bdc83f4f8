"""`workbench asm ...`: tables, JSON, exit codes and bad input, as a user meets them."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.cli import main

CROSS = Path(__file__).parent / "fixtures" / "cache"


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture
def cache(tmp_path):
    dst = tmp_path / "cache"
    shutil.copytree(CROSS, dst)
    return dst


def _hashes(capsys, cache, arch):
    _, out, _ = run_cli(capsys, "asm", "ls", "--cache", str(cache), "--arch", arch, "--json")
    rows = json.loads(out)
    by_hint = {}
    for r in rows:
        side = json.loads((Path(r["path"]) / "remote_store_kernel.workbench.json").read_text())
        by_hint[side["constexprs"]["HINT"]] = r["hash"]
    return by_hint


def test_ls_table_and_json(capsys, cache):
    code, out, _ = run_cli(capsys, "asm", "ls", "--cache", str(cache))
    assert code == 0 and out.count("remote_store_kernel") == 6 and "gfx950" in out
    code, out, _ = run_cli(capsys, "asm", "ls", "--cache", str(cache), "--json")
    rows = json.loads(out)
    assert len(rows) == 6
    for r in rows:
        assert {"hash", "name", "backend", "arch", "path", "problems"} <= set(r)
        assert r["problems"] == []


def test_ls_groups(capsys, cache):
    code, out, _ = run_cli(capsys, "asm", "ls", "--cache", str(cache), "--groups")
    assert code == 0 and "remote_store_kernel  (6 entries" in out and "constexprs.HINT" in out


def test_mix_json_default_stage_and_sass(capsys, cache):
    h = _hashes(capsys, cache, "sm90")
    code, out, _ = run_cli(capsys, "asm", "mix", h[True][:10], "--cache", str(cache), "--json")
    rows = json.loads(out)
    assert code == 0 and all({"space", "kind", "width_bits", "count"} <= set(r) for r in rows)
    stores = [r for r in rows if r["space"] == "global" and r["kind"] == "store"]
    assert [(r["width_bits"], r["count"]) for r in stores] == [(128, 2)]
    code, out, _ = run_cli(capsys, "asm", "mix", h[False][:10], "--cache", str(cache), "--stage", "sass", "--json")
    stores = [r for r in json.loads(out) if r["space"] == "global" and r["kind"] == "store"]
    assert [(r["width_bits"], r["count"]) for r in stores] == [(16, 16)]


def test_mix_opcodes(capsys, cache):
    """--opcodes counts every instruction by opcode: the unhinted remote store's byte shuffles
    (PRMT) next to its sixteen 16-bit stores, none of either with the hint."""
    h = _hashes(capsys, cache, "sm90")
    counts = {}
    for hint in (False, True):
        code, out, _ = run_cli(capsys, "asm", "mix", h[hint][:10], "--cache", str(cache), "--stage", "sass",
                               "--opcodes", "--json")
        assert code == 0
        counts[hint] = {r["opcode"]: r["count"] for r in json.loads(out)}
    assert counts[False]["STG"] == 16 and counts[True]["STG"] == 2
    assert counts[False]["PRMT"] > 0 and "PRMT" not in counts[True]
    code, out, _ = run_cli(capsys, "asm", "mix", h[False][:10], "--cache", str(cache), "--stage", "sass", "--opcodes")
    assert code == 0 and "opcode" in out and "PRMT" in out and "width_bits" not in out


def test_show_stage(capsys, cache):
    h = _hashes(capsys, cache, "gfx942")
    code, out, _ = run_cli(capsys, "asm", "show", h[True][:10], "--cache", str(cache))
    assert code == 0 and "global_store_dwordx4" in out
    code, out, _ = run_cli(capsys, "asm", "show", h[True][:10], "--cache", str(cache), "--stage", "ttgir")
    assert "tt.store" in out


def test_diff_table_and_json(capsys, cache):
    h = _hashes(capsys, cache, "gfx950")
    code, out, _ = run_cli(capsys, "asm", "diff", h[False][:10], h[True][:10], "--cache", str(cache))
    assert code == 0
    assert "instruction mix delta" in out and "global_store_short" in out and "global_store_dwordx4" in out
    assert "opcodes whose count changed (a -> b)" in out
    code, out, _ = run_cli(capsys, "asm", "diff", h[False][:10], h[True][:10], "--cache", str(cache), "--json")
    d = json.loads(out)
    stores = {r["width_bits"]: (r["count_a"], r["count_b"]) for r in d["mix"]
              if r["space"] == "global" and r["kind"] == "store"}
    assert stores == {16: (8, 0), 128: (0, 1)}
    assert d["rows"]
    ops = {r["opcode"]: r["delta"] for r in d["opcodes"]}
    assert ops["global_store_short"] == -4 and ops["global_store_dwordx4"] == 1 and 0 not in ops.values()


def test_entry_by_directory_path_and_kernel_name(capsys, cache):
    entry_dir = next(p for p in cache.iterdir() if p.is_dir())
    code, out, _ = run_cli(capsys, "asm", "mix", str(entry_dir), "--json")
    assert code == 0 and json.loads(out)
    code, _, err = run_cli(capsys, "asm", "mix", "remote_store_kernel", "--cache", str(cache))
    assert code == 2 and "6 entries of kernel" in err and "hash prefix" in err


@pytest.mark.parametrize("argv, message", [
    (["asm", "show", "ZZZZ"], "no entry with hash prefix"),
    (["asm", "show", "ZZZZ", "--stage", "nope"], "no entry with hash prefix"),
    (["asm", "mix", "/nonexistent/entry"], "no entry directory at /nonexistent/entry"),
    (["asm", "ls", "--cache", "/nonexistent/cache"], "no Triton cache at /nonexistent/cache"),
    (["asm", "compile", "kernels.comm.remote:remote_store_kernel", "--target", "sm42"], "unknown target 'sm42'"),
    (["asm", "compile", "kernels.comm.remote", "--target", "sm90"], "MODULE:FUNCTION"),
    (["asm", "compile", "no_such_module:f", "--target", "sm90"], "cannot import"),
    (["asm", "compile", "kernels.comm.remote:remote_store_kernel", "--target", "sm90"], "give a type for heap_bases"),
])
def test_bad_input_exits_2_with_a_message(capsys, cache, argv, message):
    if "--cache" not in argv:
        argv = argv + ["--cache", str(cache)]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and message in err, err


def test_ambiguous_prefix(capsys, cache):
    for suffix in ("A1", "A2"):
        (cache / f"QQQ{suffix}").mkdir()
    code, _, err = run_cli(capsys, "asm", "show", "QQQ", "--cache", str(cache))
    assert code == 2 and "ambiguous" in err


def test_damaged_entries_listed_with_problems(capsys, cache):
    (cache / "tmp.pid_77_1").mkdir()
    (cache / "tmp.pid_77_1" / "remote_store_kernel.json").write_text("{")
    code, out, _ = run_cli(capsys, "asm", "ls", "--cache", str(cache))
    assert code == 0 and "1 entries with problems" in out and "half-written" in out
    rows = json.loads(run_cli(capsys, "asm", "ls", "--cache", str(cache), "--json")[1])
    assert sum(bool(r["problems"]) for r in rows) == 1 and len(rows) == 7


def test_sass_without_cuobjdump(capsys, cache, monkeypatch):
    from workbench.asm import tools

    def missing(name):
        raise tools.ToolMissing(f"{name} not found: pip install triton==3.6.0, or put CUDA's bin on PATH")

    monkeypatch.setattr(tools, "find_tool", missing)
    h = _hashes(capsys, cache, "sm90")
    code, _, err = run_cli(capsys, "asm", "show", h[True][:10], "--cache", str(cache), "--stage", "sass")
    assert code == 2 and "cuobjdump" in err and "PATH" in err


def test_corrupt_cubin(capsys, cache):
    h = _hashes(capsys, cache, "sm90")
    cubin = next((cache / h[True]).glob("*.cubin"))
    cubin.write_bytes(cubin.read_bytes()[:200])
    code, _, err = run_cli(capsys, "asm", "mix", h[True][:10], "--cache", str(cache), "--stage", "sass")
    assert code == 2 and str(cubin.name) in err


@pytest.mark.parametrize("interpret", ["0", "1"])  # "1": compiled by a child without the interpreter
def test_console_script_compile_then_ls(tmp_path, interpret):
    """The installed `workbench` command, end to end, in a fresh process."""
    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe), "asm", "compile", "kernels.comm.remote:remote_store_kernel", "--target", "sm90,gfx942",
           "--arg", "heap_bases=*i64", "--arg", "x_ptr=*fp16", "--arg", "n=i32",
           "--constexpr", "rank=0", "--constexpr", "peer=1", "--constexpr", "BLOCK=1024", "--constexpr", "HINT=true",
           "--divisible", "heap_bases", "--divisible", "x_ptr", "--divisible", "n", "--num-warps", "4",
           "--cache", str(tmp_path), "--json"]
    env = dict(os.environ, TRITON_INTERPRET=interpret)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    made = json.loads(res.stdout)
    assert sorted(r["arch"] for r in made) == ["gfx942", "sm90"]
    res = subprocess.run([str(exe), "asm", "ls", "--cache", str(tmp_path), "--json"], capture_output=True, text=True)
    assert sorted(r["hash"] for r in json.loads(res.stdout)) == sorted(r["hash"] for r in made)


def test_mix_of_truncated_assembly_warns(capsys, cache):
    h = _hashes(capsys, cache, "sm90")
    ptx = next((cache / h[True]).glob("*.ptx"))
    ptx.write_text(ptx.read_text()[:3000])
    code, out, err = run_cli(capsys, "asm", "mix", h[True][:10], "--cache", str(cache))
    assert code == 0 and "truncated" in err and str(cache / h[True]) in err
