"""Sweeps, reports and tuning as Slurm jobs (workbench.executors.slurm, sweep_jobs, report_jobs).

The first part needs no Slurm: flags, sbatch parameters, shares, the idempotent
merge, job states. The second runs against a REAL one-node Slurm (the session
fixture ``slurm_cluster`` in conftest.py: Debian's slurmctld, slurmd and munge,
installed when root) on a toy Triton kernel in the interpreter (tests/cluster/).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from workbench import executors, jobs, sweep_jobs
from workbench.executors import slurm
from workbench.report_jobs import study_gpus

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "cluster" / "toy.yaml"
KEY = ["point_id", "variant", "repeat"]
# what differs between two runs of the same points: time, place, and the run itself
VOLATILE = re.compile(r"^(median_ms|q25_ms|q75_ms|min_ms|mean_ms|n_runs|host_us|tflops|gbps|frac_of_peak|timestamp|"
                      r"run_id|hostname|rel_err|slurm_.*|knobs)$")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    executors.add_args(p)
    return p


# ---------------------------------------------------------------------------
# without Slurm
@pytest.mark.parametrize("argv,msg", [
    (["--partition", "h100"], "--partition: only with --executor slurm"),
    (["--executor", "slurm", "--jobs", "0"], "--jobs 0"),
    (["--executor", "slurm", "--gpus-per-job", "-1"], "--gpus-per-job -1"),
    (["--executor", "slurm", "--time", "soon"], "--time 'soon'"),
    (["--executor", "slurm", "--slurm-arg", "bad key=1"], "KEY=VALUE"),
    (["--executor", "slurm", "--slurm-arg", "partition=x"], "use --partition"),
    (["--executor", "slurm", "--slurm-arg", "mem="], "non-empty"),
    (["--executor", "slurm", "--partition", "a,b"], "one partition here"),
    (["--executor", "slurm", "--partition", "a;rm"], "not a partition name"),
])
def test_bad_flags_are_refused_by_name(argv, msg):
    with pytest.raises(executors.ExecutorError, match=re.escape(msg)):
        executors.from_args(parser().parse_args(argv))


def test_sbatch_parameters_from_flags():
    args = parser().parse_args(["--executor", "slurm", "--partition", "h100", "--time", "1:30:00", "--account", "kern",
                                "--qos", "high", "--slurm-arg", "constraint=sm90", "--slurm-arg=--mem=64G",
                                "--slurm-arg", "exclusive"])
    executors.from_args(args)
    p = slurm.slurm_parameters(args, gpus=2, name="wb-x", parallelism=3)
    assert p["partition"] == "h100" and p["time"] == 90 and p["gpus_per_node"] == 2
    assert p["account"] == "kern" and p["qos"] == "high" and p["array_parallelism"] == 3
    assert p["additional_parameters"] == {"constraint": "sm90", "mem": "64G", "exclusive": True}
    none = slurm.slurm_parameters(parser().parse_args(["--executor", "slurm", "--gpus-per-job", "0"]), gpus=2)
    assert "gpus_per_node" not in none and "partition" not in none and none["time"] == 60
    assert [slurm.parse_time_min(t) for t in ("5", "10:30", "2:00:00", "1-0", "1-02:03")] == [5, 11, 120, 1440, 1563]
    # submitit accepts them all (it checks parameter names and formats the sbatch file)
    from submitit.slurm.slurm import _make_sbatch_string

    text = _make_sbatch_string(command="true", folder="/tmp/x", **p)
    assert "#SBATCH --constraint=sm90" in text and "#SBATCH --exclusive" in text and "--gpus-per-node=2" in text


def test_shares_are_contiguous_and_cover_every_point():
    keys = list(range(10))
    shares = sweep_jobs.split(keys, 4)
    assert [len(s) for s in shares] == [3, 3, 2, 2] and sum(shares, []) == keys
    assert sweep_jobs.split(keys[:2], 8) == [[0], [1]]


def test_study_gpus_reads_the_notebooks_plan_call():
    nb = ROOT / "notebooks"
    assert study_gpus(nb / "01_isa_hints.ipynb", {}) == 1
    assert study_gpus(nb / "03_all_gather.ipynb", {}) == 2
    assert study_gpus(nb / "05_all_gather_gemm.ipynb", {"world_size": 4}) == 4


def _row(pid, variant="triton", rep=0, run="c1", status="ok", part="debug"):
    return {"run_id": run, "point_id": pid, "variant": variant, "repeat": rep, "status": status, "device_name": "cpu",
            "slurm_partition": part, "median_ms": 1.0}


def test_merge_is_idempotent_and_never_duplicates(tmp_path):
    from workbench import sweep

    run_dir = tmp_path / "slurm" / "c1"
    shares = [[["a", "triton", 0], ["b", "triton", 0]], [["c", "triton", 0]]]
    jobs.write_json(run_dir / "plan.json", {"run_id": "c1", "shares": shares})
    (run_dir / "task_0").mkdir(parents=True)
    (run_dir / "task_1").mkdir()
    # job 0 wrote a, then (requeued) a again and b; job 1 wrote a row that is not its own
    pd.DataFrame([_row("a"), _row("a"), _row("b")]).to_parquet(run_dir / "task_0" / "rows.parquet")
    pd.DataFrame([_row("c", status="not_run"), _row("zz")]).to_parquet(run_dir / "task_1" / "rows.parquet")
    store = sweep.RowStore(tmp_path)
    run = sweep_jobs._Run(run_dir)
    assert run.merge(store, force=True) == 3
    for _ in range(2):  # again, in this process and in a fresh one: nothing new
        assert sweep_jobs._Run(run_dir).merge(sweep.RowStore(tmp_path), force=True) == 0
    df = pd.read_parquet(tmp_path / "rows.parquet")
    assert sorted(df["point_id"]) == ["a", "b", "c"]
    # c is run again by a later submission: its not_run row is replaced, and stays replaced
    store = sweep.RowStore(tmp_path)
    store.add(_row("c", run="c2"))
    store.flush()
    assert sweep_jobs._Run(run_dir).merge(sweep.RowStore(tmp_path), force=True) == 0
    df = pd.read_parquet(tmp_path / "rows.parquet")
    assert sorted(zip(df["point_id"], df["status"])) == [("a", "ok"), ("b", "ok"), ("c", "ok")]


def _ref(tmp_path, jid="7_1", own=None):
    status = tmp_path / f"{jid}.json"
    if own is not None:
        jobs.write_json(status, own)
    return jobs.JobRef(job_id=jid, name="share 2/4", folder=str(tmp_path), status=str(status))


def _status(ref, state, node="gpu07"):
    view = slurm._SchedulerView()
    view.info = {ref.job_id: {"state": state, "node": node}}
    return slurm._status(ref, view)


def test_job_status_combines_slurm_and_the_jobs_own_word(tmp_path):
    assert _status(_ref(tmp_path), "PENDING").phase == "pending"
    assert _status(_ref(tmp_path, own={"state": "running"}), "RUNNING").phase == "running"
    # requeued after it stopped: Slurm's word wins
    assert _status(_ref(tmp_path, own={"state": "stopped", "error": "x"}), "PENDING").phase == "pending"
    # finished its work just as it was cancelled: done
    assert _status(_ref(tmp_path, own={"state": "done"}), "CANCELLED").phase == "done"
    failed = _status(_ref(tmp_path, own={"state": "failed", "error": "SpecError: toy.yaml: grid..."}), "FAILED")
    assert failed.phase == "failed" and "SpecError: toy.yaml" in failed.line() and "log: " in failed.line()
    dead = _status(_ref(tmp_path, own={"state": "running", "node": "gpu07"}), "NODE_FAIL")
    assert dead.phase == "failed" and "node gpu07 failed (NODE_FAIL)" in dead.error
    gone = _status(_ref(tmp_path, own={"state": "running"}), "FORGOTTEN", node="")
    assert gone.phase == "failed" and "no longer knows" in gone.error
    assert _status(_ref(tmp_path, own={"state": "running"}), "UNKNOWN").phase == "running"
    assert slurm._expand("0-2,5%2") == ["0", "1", "2", "5"]
    assert slurm._compact(["12_0", "12_1", "12_2", "12_5", "14"]) == "12_[0-2,5], 14"


def test_cluster_flags_without_slurm_fail_before_anything_runs(tmp_path, capsys):
    from workbench.cli import main

    assert main(["sweep", str(TOY), "--results", str(tmp_path), "--jobs", "4"]) == 2
    assert "--jobs: only with --executor slurm" in capsys.readouterr().err
    assert main(["sweep", str(TOY), "--results", str(tmp_path), "--collect", "--jobs", "2"]) == 2
    assert "--collect submits nothing: leave out --jobs" in capsys.readouterr().err
    assert main(["report", "--all", "--collect", "--out", str(tmp_path)]) == 2
    assert "--collect runs no notebook" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------
# against a real Slurm
def workbench(*args, env=None, timeout=240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "workbench.cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def slurm_sweep(results, *extra, env=None, timeout=240):
    return workbench("sweep", TOY, "--results", results, "--no-progress", "--executor", "slurm",
                     "--gpus-per-job", "0", *extra, env=env, timeout=timeout)


def rows(folder: Path) -> pd.DataFrame:
    return pd.read_parquet(folder / "rows.parquet").sort_values(KEY).reset_index(drop=True)


def one_run(folder: Path) -> Path:
    (run,) = [d for d in (folder / "slurm").iterdir() if (d / "plan.json").exists()]
    return run


def own(run: Path, i: int) -> dict:
    """What job i of a submission says of itself (its status file)."""
    return jobs.read_json(next((run / "status").glob(f"*_{i}.json")), {}) or {}


def wait_for(cond, timeout_s: float, what: str):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        got = cond()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slurm
def test_sweep_as_job_array_matches_the_local_sweep(slurm_cluster, tmp_path):
    local = workbench("sweep", TOY, "--results", tmp_path / "local", "--no-progress")
    assert local.returncode == 0, local.stderr
    res = workbench("sweep", TOY, "--results", tmp_path / "slurm", "--executor", "slurm", "--jobs", "4",
                    "--gpus-per-job", "0")
    assert res.returncode == 0, res.stderr
    assert "submitted 4 job(s)" in res.stderr and "4 done" in res.stderr
    assert "pt/s" in res.stderr and "44/44" in res.stderr  # the progress bar across the cluster
    a, b = rows(tmp_path / "local"), rows(tmp_path / "slurm")
    assert len(a) == len(b) == 44 and (b["status"] == "ok").all()
    same = [c for c in a.columns if not VOLATILE.match(c)]
    assert set(same) <= set(b.columns)
    pd.testing.assert_frame_equal(a[same], b[same], check_dtype=False)
    # each job's rows carry where they were measured
    assert sorted(b["slurm_array_task_id"].unique()) == ["0", "1", "2", "3"]
    assert b["slurm_array_job_id"].nunique() == 1 and b["slurm_job_id"].nunique() == 4
    assert set(b["slurm_node"]) == {"wbnode"} and set(b["slurm_partition"]) == {"debug"}
    assert {"git_sha", "torch_version", "triton_version", "device_name", "slurm_gpus"} <= set(b.columns)
    assert b["run_id"].nunique() == 1
    refs = jobs.load(one_run(tmp_path / "slurm"))
    assert slurm.SlurmExecutor().result(refs[0]) == {"rows": 11, "status": {"ok": 11}}  # what the job's function returned
    logs = sorted((one_run(tmp_path / "slurm") / "logs").glob("*_log.out"))
    assert len(logs) == 4 and all("sacct" not in p.read_text() for p in logs)
    assert "sacct" not in res.stderr and "Bypassing" not in res.stderr


@pytest.mark.slurm
def test_cancel_and_requeue_mid_run_then_resume_records_every_point_once(slurm_cluster, tmp_path):
    out = tmp_path / "r"
    res = slurm_sweep(out, "--jobs", "4", "--detach", env={"CLUSTER_TOY_SLEEP_S": "0.6"})
    assert res.returncode == 0, res.stderr
    assert "detached; merge the rows later with: workbench sweep" in res.stderr
    run = one_run(out)
    array = jobs.load(run)[0].array_id

    def has_rows(i):
        return lambda: (run / f"task_{i}" / "rows.parquet").exists() and \
            pd.read_parquet(run / f"task_{i}" / "rows.parquet").shape[0] >= 2

    wait_for(has_rows(0), 90, "job 0's first rows")
    subprocess.run(["scancel", f"{array}_0"], check=True)
    wait_for(has_rows(1), 90, "job 1's first rows")
    assert len(pd.read_parquet(run / "task_1" / "rows.parquet")) < 11  # still mid-run
    # What Slurm's step daemon sends before a time limit (sbatch --signal): submitit checkpoints the
    # job and requeues it. (Sent to the job's process as the step daemon would: `scancel --signal`
    # would wait on the job's own `scontrol requeue` for a minute and a half.)
    os.kill(int(own(run, 1)["pid"]), signal.SIGUSR2)
    # Slurm holds a requeued job back two minutes: let it start again now
    wait_for(lambda: "BeginTime" in subprocess.run(["squeue", "-h", "-j", f"{array}_1", "-o", "%r"],
                                                   capture_output=True, text=True).stdout, 60, "the requeue")
    subprocess.run(["scontrol", "update", f"JobId={array}_1", "StartTime=now"], check=True)
    wait_for(lambda: own(run, 0).get("state") == "stopped", 60, "job 0 to stop")
    assert "SIGTERM" in own(run, 0)["error"]
    res = slurm_sweep(out, "--jobs", "2", "--resume")
    assert res.returncode == 0, res.stderr
    assert "to come from jobs still queued or running" in res.stderr
    df = rows(out)
    assert len(df) == 44 and not df.duplicated(KEY).any() and (df["status"] == "ok").all()
    assert df["run_id"].nunique() == 2  # the cancelled job's rest came from the resumed submission
    t1 = pd.read_parquet(run / "task_1" / "rows.parquet")
    assert not t1.duplicated(KEY).any() and len(t1) == 11  # the requeued job went on from its own rows
    assert own(run, 1)["restarts"] == 1 and "Requeued job" in jobs.load(run)[1].log.read_text()
    assert (run / "merged.json").exists()
    again = workbench("sweep", TOY, "--results", out, "--collect")
    assert again.returncode == 0 and rows(out).equals(df)


@pytest.mark.slurm
def test_detach_then_collect(slurm_cluster, tmp_path):
    out = tmp_path / "d"
    t0 = time.monotonic()
    res = slurm_sweep(out, "--quick", "--jobs", "2", "--detach")
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - t0 < 60 and not (out / "rows.parquet").exists()
    m = re.search(r"merge the rows later with: (workbench sweep .*--collect.*?) \(", res.stderr)
    assert m and "--quick" in m.group(1) and str(out) in m.group(1)
    res = workbench("sweep", TOY, "--quick", "--results", out, "--collect", "--wait", "--no-progress")
    assert res.returncode == 0, res.stderr
    df = rows(out)
    assert len(df) == 6 and not df.duplicated(KEY).any() and (df["status"] == "ok").all()  # 2 shapes x 2 blocks + 2
    res = workbench("sweep", TOY, "--quick", "--results", out, "--collect")
    assert res.returncode == 0 and "2 done" in res.stderr and rows(out).equals(df)
    res = slurm_sweep(out, "--quick", "--jobs", "2")
    assert res.returncode == 0 and "nothing to run" in res.stderr


@pytest.mark.slurm
def test_a_job_whose_spec_broke_fails_with_the_specs_error(slurm_cluster, tmp_path):
    spec = tmp_path / "toy.yaml"
    spec.write_text(TOY.read_text())
    cpus = slurm_cluster.cpus
    block = subprocess.run(["sbatch", "--parsable", "-c", str(cpus), "-o", "/dev/null", "--wrap", "sleep 120"],
                           capture_output=True, text=True, check=True).stdout.strip()
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        parent = subprocess.Popen([sys.executable, "-m", "workbench.cli", "sweep", str(spec), "--results",
                                   str(tmp_path / "r"), "--executor", "slurm", "--jobs", "2", "--gpus-per-job", "0",
                                   "--no-progress"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: list((tmp_path / "r" / "slurm").glob("*/jobs.json")), 60, "the submission")
        broken = yaml.safe_load(spec.read_text())
        broken["grid"]["params"]["BLOK"] = [8]  # edited while the jobs wait: a name the kernel does not have
        spec.write_text(yaml.safe_dump(broken))
    finally:
        subprocess.run(["scancel", block], check=True)
    _, err = parent.communicate(timeout=120)
    assert parent.returncode == 1, err
    assert "SpecError" in err and "params.BLOK: unknown parameter" in err and "failed" in err, err
    assert err.count("params.BLOK: unknown parameter") == 2  # one line per job
    assert re.search(r"log: \S+_log\.out", err) and "failed with points missing" in err


@pytest.mark.slurm
def test_report_of_study01_through_slurm_has_the_local_sections(slurm_cluster, tmp_path, tmp_path_factory):
    from test_report import study_report

    local = study_report(tmp_path_factory)  # the session's local report of study 01 (shared with test_report)
    cache = tmp_path_factory.getbasetemp() / "study01-cache"
    res = workbench("report", ROOT / "notebooks" / "01_isa_hints.ipynb", "--out", tmp_path, "--no-progress",
                    "--executor", "slurm", "--gpus-per-job", "0", env={"WORKBENCH_ISA_CACHE": str(cache)})
    assert res.returncode == 0, res.stderr
    assert re.search(r"01_isa_hints ok in .* \(job \d+ on wbnode\)", res.stderr)

    def sections(folder):
        page = (folder / "01_isa_hints.html").read_text()
        return re.findall(r"<h([1-3])[^>]*>(.*?)<a class=\"anchor-link\"", page)

    assert sections(tmp_path) == sections(local) and len(sections(tmp_path)) >= 8
    assert (tmp_path / "01_isa_hints.ipynb").exists()
    rec = json.loads((tmp_path / "01_isa_hints.report.json").read_text())
    assert rec["ok"] and rec["job"]["node"] == "wbnode" and rec["machine"]["hostname"]
    assert 'data-name="01_isa_hints"' in (tmp_path / "index.html").read_text()


@pytest.mark.slurm
def test_a_failed_notebook_names_its_job_and_log(slurm_cluster, tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("raise RuntimeError('study broke on purpose')")]
    path = tmp_path / "nb" / "09_broken.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, str(path))
    res = workbench("report", path, "--out", tmp_path / "out", "--no-progress", "--executor", "slurm",
                    "--gpus-per-job", "0")
    assert res.returncode == 1, res.stderr
    m = re.search(r"09_broken FAILED \(RuntimeError: study broke on purpose.*\) in job (\d+) on wbnode; log: (\S+?);",
                  res.stderr)
    assert m and Path(m.group(2)).exists(), res.stderr
    index = (tmp_path / "out" / "index.html").read_text()
    assert f"Slurm job <code>{m.group(1)}</code>" in index and m.group(2) in index
    assert (tmp_path / "out" / "09_broken.html").exists()  # the report up to the error, as locally


def test_a_report_job_that_died_is_a_failed_entry_with_its_job_and_log(tmp_path, capsys):
    from workbench import report_jobs

    run = tmp_path / "slurm" / "r1"
    jobs.write_json(run / "notebooks.json", {"31_2": "notebooks/03_all_gather.ipynb"})
    ref = jobs.JobRef(job_id="31_2", name="03_all_gather", folder=str(run / "logs"),
                         status=str(run / "status" / "x.json"))
    st = jobs.JobStatus("31_2", "03_all_gather", "failed", "NODE_FAIL", "gpu07",
                           "node gpu07 failed (NODE_FAIL) while the job ran", str(ref.log), {"state": "running"})
    args = argparse.Namespace(cancel_on_interrupt=False)
    reports = report_jobs.Reports(args, tmp_path, None)
    assert reports._record(ref, st) == 1
    assert "03_all_gather FAILED: job 31_2" in capsys.readouterr().err
    rec = json.loads((tmp_path / "03_all_gather.report.json").read_text())
    assert not rec["ok"] and "NODE_FAIL" in rec["error"] and rec["notebook"].endswith("03_all_gather.ipynb")
    index = reports._index().read_text()
    assert "Slurm job <code>31_2</code> on gpu07" in index and "31_2_0_log.out" in index


@pytest.mark.slurm
def test_ctrl_c_says_how_to_collect_and_cancels_only_when_asked(slurm_cluster, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CLUSTER_TOY_SLEEP_S": "2"}

    def interrupted(out, *extra):
        p = subprocess.Popen([sys.executable, "-m", "workbench.cli", "sweep", str(TOY), "--quick", "--results",
                              str(out), "--executor", "slurm", "--jobs", "2", "--gpus-per-job", "0", "--no-progress",
                              *extra],
                             cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: list((out / "slurm").glob("*/jobs.json")), 60, "the submission")
        time.sleep(2)  # into the wait
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        return p.returncode, err, jobs.load(one_run(out))

    rc, err, refs = interrupted(tmp_path / "a")
    assert rc == 130 and "nothing was cancelled" in err, err
    assert f"workbench sweep {TOY} --collect --quick --results {tmp_path / 'a'}" in err
    live = subprocess.run(["squeue", "-h", "-j", refs[0].array_id], capture_output=True, text=True).stdout
    assert live.strip(), "the jobs went on"
    slurm.SlurmExecutor().cancel(refs)
    rc, err, refs = interrupted(tmp_path / "b", "--cancel-on-interrupt")
    assert rc == 130 and "interrupted: cancelled 2 job(s)" in err, err
    wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", refs[0].array_id], capture_output=True,
                                        text=True).stdout.strip(), 60, "the cancelled jobs to leave")


@pytest.mark.slurm
def test_two_gpu_study_asks_for_two_gpus_and_sbatch_refusal_is_clear(slurm_cluster, tmp_path):
    res = workbench("report", ROOT / "notebooks" / "03_all_gather.ipynb", "--out", tmp_path, "--executor", "slurm",
                    "--detach")
    assert res.returncode == 2 and "sbatch refused the jobs" in res.stderr, res.stderr  # this cluster has no GPUs
    (script,) = (tmp_path / "slurm").glob("*/logs/.submission_file_*.sh")
    assert "#SBATCH --gpus-per-node=2" in script.read_text()


@pytest.mark.slurm
def test_a_point_that_kills_its_job_is_recorded_crashed_and_skipped_on_resume(slurm_cluster, tmp_path):
    out, env = tmp_path / "c", {"CLUSTER_TOY_CRASH": "300,128"}
    res = slurm_sweep(out, "--quick", "--jobs", "2", env=env)
    assert res.returncode == 1 and "failed with points missing" in res.stderr, res.stderr
    assert re.search(r"job \S+ \[share 2/2: 3 rows\] failed on wbnode: the job ended \(FAILED\) before it finished; "
                     r"last log line: .*Aborted", res.stderr), res.stderr
    res = slurm_sweep(out, "--quick", "--jobs", "2", env=env)  # the same crash still armed
    assert res.returncode == 0 and "it is recorded as crashed" in res.stderr, res.stderr
    df = rows(out)
    assert len(df) == 6 and not df.duplicated(KEY).any()
    crashed = df[df["status"] == "crashed"]
    assert len(crashed) == 1 and crashed.iloc[0]["n"] == 300 and crashed.iloc[0]["p_BLOCK"] == 128
    assert (df.drop(crashed.index)["status"] == "ok").all()


@pytest.mark.slurm
def test_tune_as_a_job_per_partition_builds_the_table(slurm_cluster, tmp_path):
    """``workbench tune gemm --executor slurm``: the job (the test node has no GPU: the interpreter)
    tunes the spec into the tables under --out, the parent says how it ended; --detach then
    --collect says the same later."""
    out = tmp_path / "tables"
    shapes = "M=9,N=16,K=24;M=5,N=8,K=40,dtype=float16"
    res = workbench("tune", "gemm", "--shapes", shapes, "--budget-s", "0.2", "--out", out, "--times",
                    tmp_path / "times.csv", "--executor", "slurm", "--partition", "debug", "--gpus-per-job", "0",
                    timeout=300)
    assert res.returncode == 0, res.stderr
    assert "submitted 1 job(s) (debug/gemm)" in res.stderr and "debug/gemm: 2 entries tuned on" in res.stderr
    from kernels.common import select, tables

    table = tables.table_path(out, select.device_of(None), "gemm")
    assert len(tables.read(table)) == 2 and (tmp_path / "times_debug.csv").exists()
    res = workbench("tune", "gemm", "--shapes", shapes, "--out", out, "--executor", "slurm", "--partition", "debug",
                    "--gpus-per-job", "0", "--detach", timeout=120)
    assert res.returncode == 0 and "see how they ended later with: workbench tune --collect" in res.stderr
    res = None
    for _ in range(200):   # the job resumes: both shapes are in the table, nothing to tune
        res = workbench("tune", "--collect", "--out", out, timeout=60)
        if "debug/gemm: 0 entries tuned" in res.stderr:
            break
        time.sleep(0.5)
    assert res.returncode == 0 and "debug/gemm: 0 entries tuned" in res.stderr, res.stderr
    bad = workbench("tune", "gemm", "--shapes", shapes, "--partition", "debug")
    assert bad.returncode == 2 and "--executor slurm" in bad.stderr
