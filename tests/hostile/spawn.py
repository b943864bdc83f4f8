"""Run commands a few at a time and measure each one: exit status, wall time, peak RSS.

    python tests/hostile/spawn.py JOBS.json RESULTS.json WORKERS

JOBS.json: [{"argv": [...], "env": {...}, "cwd": "...", "deadline_s": 30}, ...]
RESULTS.json gets, per job: rc, wall, rss_mb, timed_out, out, err.

Why a process of its own: Linux counts, in a child's peak RSS, the memory of
the process it was forked from (its pages are the child's until exec). From
a test process holding torch that is ~800 MB of someone else's memory; from
this small process it is ~20 MB. `os.wait4` gives each child's own rusage
(its reaped descendants included: a disassembler, a notebook kernel).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def run(job: dict) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(job["argv"], cwd=job["cwd"], env=job["env"], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, start_new_session=True)
        timed_out = False
        while True:  # wait4, not Popen.wait: this child's own rusage
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > job["deadline_s"]:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.01)
        wall = time.monotonic() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; Popen must not wait again
        texts = []
        for fh in (out, err):
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 200_000))
            texts.append(fh.read().decode(errors="replace"))
    return {"rc": proc.returncode, "wall": wall, "rss_mb": usage.ru_maxrss / 1024, "timed_out": timed_out,
            "out": texts[0], "err": texts[1]}


def main() -> None:
    jobs_path, results_path, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(jobs_path) as fh:
        jobs = json.load(fh)
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(run, jobs))
    with open(results_path, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main()
