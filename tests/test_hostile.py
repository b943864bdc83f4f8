"""The hostile-input corpus (tests/hostile/): damaged caches, hostile specs, report
parameters and launcher arguments, each run as a user would run it.

Every command runs in its own process, started by tests/hostile/spawn.py
(peak resident memory is per command: `os.wait4` gives each child's rusage) and must: exit with an allowed status
and no traceback, say what its case expects (the refusal is reported, with
what to do), finish within its deadline, stay under 512 MB resident, and
leave no canary file (no payload ran). The cache tree is checksummed before
and after: nothing may change it. Commands run a few at a time.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ROOT / "tests" / "hostile"
MAX_RSS_MB = 512
WORKERS = max(2, min(4, os.cpu_count() or 2))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_hostile_{name}", HOSTILE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


corpus = _load("make_corpus")


def tree_state(top: Path) -> dict:
    """{path: (kind, size, mtime, content hash)} without following links or opening special files."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode) and st.st_size <= 16 << 20:
                with open(p, "rb") as fh:
                    digest = hashlib.sha256(fh.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            state[p] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return state


def run_all(jobs: list[dict], work: Path, workers: int) -> list[dict]:
    """Run `jobs` through tests/hostile/spawn.py (a small process: see there why); one result each."""
    jobs_path, results_path = work / "jobs.json", work / "results.json"
    jobs_path.write_text(json.dumps(jobs))
    budget = sum(j["deadline_s"] for j in jobs) / workers + 60
    subprocess.run([sys.executable, str(HOSTILE / "spawn.py"), str(jobs_path), str(results_path), str(workers)],
                   check=True, timeout=budget, stdin=subprocess.DEVNULL)
    results = json.loads(results_path.read_text())
    for r in results:
        r["text"] = r.pop("out") + "\n" + r.pop("err")
    return results


def _job(argv: list[str], env: dict, cwd: Path, deadline_s: float) -> dict:
    return {"argv": [sys.executable, *argv], "env": _env(env), "cwd": str(cwd), "deadline_s": deadline_s}


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKBENCH_", "TRITON_CUOBJDUMP", "TRITON_NVDIS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HOSTILE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TRITON_INTERPRET"] = "1"
    env.update(extra)
    return env


def _canaries(*tops: Path) -> list[str]:
    found = []
    for top in tops:
        for dirpath, _, filenames in os.walk(top, followlinks=False):
            found += [os.path.join(dirpath, n) for n in filenames if n == corpus.CANARY]
    return found


def _problems(case, res) -> list[str]:
    why = []
    if res["timed_out"] or res["wall"] > case.deadline_s:
        why.append(f"took {res['wall']:.1f} s (deadline {case.deadline_s} s)")
    if "Traceback (most recent call last)" in res["text"]:
        why.append("printed a traceback")
    if res["rc"] not in case.rcs:
        why.append(f"exit status {res['rc']} (allowed: {case.rcs})")
    if res["rss_mb"] >= MAX_RSS_MB:
        why.append(f"peak RSS {res['rss_mb']:.0f} MB")
    if case.expect and case.expect not in res["text"]:
        why.append(f"output lacks {case.expect!r}")
    return why


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    cases = corpus.build(root)
    (root / "work").mkdir()
    return root, cases


def test_hostile_corpus(built):
    root, cases = built
    assert len(cases) >= 100
    before = tree_state(root / "cache")
    outside = tree_state(root / "outside")
    t0 = time.monotonic()
    results = run_all([_job(c.argv, c.env, root / "work", c.deadline_s) for c in cases], root / "work", WORKERS)
    elapsed = time.monotonic() - t0
    failures = [f"{c.name}: {'; '.join(why)}\n    python {' '.join(c.argv)[:300]}\n    "
                f"{res['text'].strip()[-600:]}"
                for c, res in zip(cases, results) if (why := _problems(c, res))]
    slowest = sorted(zip(results, cases), key=lambda rc: -rc[0]["wall"])[:5]
    heaviest = max(results, key=lambda r: r["rss_mb"])
    print(f"\n{len(cases)} hostile commands in {elapsed:.1f} s on {WORKERS} workers; peak RSS "
          f"{heaviest['rss_mb']:.0f} MB; slowest: " + ", ".join(f"{c.name} {r['wall']:.1f}s" for r, c in slowest))
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)
    assert not _canaries(root), "a payload ran: canary file created"
    assert tree_state(root / "cache") == before, "the cache changed"
    assert tree_state(root / "outside") == outside, "files the cache points at changed"


def test_hostile_launcher_arguments(tmp_path):
    (res,) = run_all([_job([str(HOSTILE / "launcher_cases.py")], {}, tmp_path, 90)], tmp_path, 1)
    assert res["rc"] == 0 and "Traceback" not in res["text"], res["text"][-3000:]
    assert res["rss_mb"] < MAX_RSS_MB, f"peak RSS {res['rss_mb']:.0f} MB"
    lines = [json.loads(line) for line in res["text"].splitlines() if line.startswith("{")]
    records = [r for r in lines if "name" in r]
    assert lines[-1] == {"total": len(records)} and len(records) >= 40
    bad = [r for r in records if r["raised"] != "ValueError" or r["expect"] not in r["message"]
           or r["seconds"] > 5]
    assert not bad, "\n".join(json.dumps(r) for r in bad)
    assert not _canaries(tmp_path)


def _tool(tmp_path: Path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(0o755)
    return str(p)


def test_tools_share_one_deadline_and_a_bounded_output(tmp_path, monkeypatch):
    from workbench.asm import tools

    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"\x7fELF" + bytes(64))
    monkeypatch.setenv("TRITON_CUOBJDUMP_PATH", _tool(tmp_path, "fail", "echo broken >&2\nexit 1\n"))
    monkeypatch.setenv("TRITON_NVDISASM_PATH", _tool(tmp_path, "hang", "sleep 300 &\nwait\n"))
    t0 = time.monotonic()
    with pytest.raises(tools.ToolTimeout, match=r"within the 1 s allowed .*WORKBENCH_ASM_TOOL_TIMEOUT_S"):
        tools.sass_from_cubin(cubin, tools.Deadline(1))
    assert time.monotonic() - t0 < 3  # the failing cuobjdump's time counts; the hung nvdisasm is killed
    monkeypatch.setenv("TRITON_CUOBJDUMP_PATH", _tool(tmp_path, "flood", "exec yes STG.E.128\n"))
    with pytest.raises(tools.ToolFailed, match="wrote more than 1,048,576 bytes"):
        tools.run_tool("cuobjdump", ["-sass", str(cubin)], max_output=1 << 20)
    monkeypatch.setenv("WORKBENCH_ASM_TOOL_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="WORKBENCH_ASM_TOOL_TIMEOUT_S"):
        tools.Deadline()


def test_bounded_reads(tmp_path, monkeypatch):
    from workbench.asm import reading

    entry = tmp_path / "entry"
    entry.mkdir()
    ok = entry / "k.ptx"
    ok.write_bytes(b"x" * 100)
    assert reading.read_bytes(ok, 100, entry) == b"x" * 100
    assert reading.read_bytes(ok, 10, entry, head=True) == b"x" * 10
    with pytest.raises(reading.Refused, match="100 bytes, over the .* read cap"):
        reading.read_bytes(ok, 99, entry)
    os.mkfifo(entry / "fifo.ptx")
    with pytest.raises(reading.Refused, match="a FIFO, not a regular file"):
        reading.read_bytes(entry / "fifo.ptx", 100, entry)
    (entry / "zero.ptx").symlink_to("/dev/zero")
    with pytest.raises(reading.Refused, match="symlink leading out of entry"):
        reading.read_bytes(entry / "zero.ptx", 100, entry)
    with pytest.raises(reading.Refused, match="a character device"):
        reading.read_bytes(entry / "zero.ptx", 100)  # no root: still not a regular file
    (entry / "inside.ptx").symlink_to("k.ptx")
    assert reading.read_bytes(entry / "inside.ptx", 100, entry) == b"x" * 100
    monkeypatch.setenv(reading.ENV_MAX_FILE_MB, "0.5")
    assert reading.max_file_bytes() == 1 << 19 and reading.max_file_bytes(7) == 7
    monkeypatch.setenv(reading.ENV_MAX_FILE_MB, "-3")
    with pytest.raises(ValueError, match="WORKBENCH_ASM_MAX_FILE_MB"):
        reading.max_file_bytes()
