"""workbench.executors: the one interface the sweep, report and tuner hand their work units to.

CPU only, no Slurm needed: the backends found by module name, the flags each one takes (a flag of
another backend refused by name), and the local backend, which runs the units here in order,
isolates a unit's failure like a job's, and raises it again from `result`. The Slurm backend
against a real cluster: tests/test_cluster.py.
"""
from __future__ import annotations

import argparse

import pytest

from workbench import executors, jobs
from workbench.executors import ExecutorError
from workbench.executors.local import LocalExecutor


def parse(*argv, multi_place=False):
    p = argparse.ArgumentParser()
    executors.add_args(p, multi_place=multi_place)
    return executors.from_args(p.parse_args(list(argv)), multi_place=multi_place)


def test_backends_are_the_modules_of_the_package_local_first():
    assert executors.names()[0] == "local" and "slurm" in executors.names()
    for name in executors.names():
        cls = executors.backend(name)
        assert issubclass(cls, executors.Executor) and cls.NAME == name and cls.HELP
    with pytest.raises(ExecutorError, match="--executor 'ray': choose one of local, slurm"):
        executors.backend("ray")
    assert executors.for_ref(jobs.JobRef("1_0", "x", "/tmp", "/tmp/s.json")).NAME == "slurm"   # older records


def test_the_command_line_chooses_and_checks_flags_by_backend():
    ex = parse()
    assert isinstance(ex, LocalExecutor) and ex.RUNS_HERE and ex.places() == [None]
    slurm = parse("--executor", "slurm", "--partition", "h100,h200", "--jobs", "3", "--gpus-per-job", "0",
                  multi_place=True)
    assert slurm.NAME == "slurm" and not slurm.RUNS_HERE and slurm.places() == ["h100", "h200"]
    assert slurm.jobs == 3 and slurm.gpus_for(2) == 0 and parse("--executor", "slurm").gpus_for(2) == 2
    for argv, said in ((["--jobs", "2"], "--jobs: only with --executor slurm"),
                       (["--detach"], "--detach: only with --executor slurm"),
                       (["--time", "5"], "--time: only with --executor slurm"),
                       (["--executor", "slurm", "--partition", "a,b"], "one partition here")):
        with pytest.raises(ExecutorError, match=said):
            parse(*argv)
    p = argparse.ArgumentParser()
    executors.add_args(p)
    with pytest.raises(ExecutorError, match="--collect submits nothing: leave out --executor slurm"):
        executors.from_args(p.parse_args(["--executor", "slurm"]), collecting=True)
    assert executors.from_args(p.parse_args(["--cancel-on-interrupt"]), collecting=True).RUNS_HERE


def test_local_units_run_here_in_order_and_fail_like_jobs():
    ran, ended, said = [], [], []

    def unit(x):
        ran.append(x)
        if x == 2:
            raise ValueError(f"unit {x} broke")
        return x * 10

    ex = LocalExecutor()
    refs = ex.submit(unit, [(1,), (2,), (3,)], folder=None, names=["one", "two", "three"])
    assert not ran and [st.phase for st in ex.statuses(refs).values()] == ["pending"] * 3   # queued, not run
    final = ex.wait(refs, on_end=lambda ref, st: ended.append((ref.name, st.phase, list(ran))), log=said.append)
    assert ran == [1, 2, 3]   # the one that failed did not stop the others
    assert ended == [("one", "done", [1]), ("two", "failed", [1, 2]), ("three", "done", [1, 2, 3])]
    assert said == ["[1/3] running one ...", "[2/3] running two ...", "[3/3] running three ..."]
    assert final[refs[1].job_id].error == "ValueError: unit 2 broke" and "failed" in final[refs[1].job_id].line()
    assert ex.result(refs[0]) == 10 and ex.result(refs[2]) == 30
    with pytest.raises(ValueError, match="unit 2 broke"):
        ex.result(refs[1])
    assert all(r.executor == "local" and not r.status for r in refs)   # no status files: nothing to collect


def test_local_interrupt_leaves_the_rest_unrun_and_cancel_drops_queued_units():
    ran = []

    def unit(x):
        ran.append(x)
        if x == 1:
            raise KeyboardInterrupt

    ex = LocalExecutor()
    refs = ex.submit(unit, [(0,), (1,), (2,)], names=["a", "b", "c"], folder=None)
    with pytest.raises(KeyboardInterrupt):
        ex.wait(refs, log=lambda s: None)
    assert ran == [0, 1]
    ex.cancel(refs)
    st = ex.statuses(refs)[refs[2].job_id]
    assert st.phase == "failed" and st.state == "CANCELLED"
    with pytest.raises(RuntimeError, match="has not run"):
        ex.result(refs[2])
