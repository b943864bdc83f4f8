"""A real one-node Slurm cluster on this machine, for the cluster tests and `make slurm-test`.

    python tests/slurm_cluster.py            # start it, print how to use it, stop it on Ctrl-C
    python tests/slurm_cluster.py --install  # first install Debian's slurm-wlm and munge (root)

From Python (the session fixture in tests/test_cluster.py)::

    with LocalSlurm() as cluster:        # munged, slurmctld and slurmd, node idle
        env = cluster.env()              # SLURM_CONF=... for sbatch, squeue, submitit
        ...
    # every process it started is stopped, by its pid

Everything lives in one temporary folder (0755, as munged wants every folder
above its socket): a munge key and socket of its own, a ``slurm.conf`` with
free private ports, one node with this machine's CPUs in a ``debug``
partition (``select/cons_tres``, ``proctrack/linuxproc``, ``task/none``: no
cgroups needed) and state/spool folders. Accounting is off
(``accounting_storage/none``), so ``sacct`` has nothing to say: the workbench
reads job states from ``scontrol show job`` when ``sacct`` fails
(``workbench.executors.slurm``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")  # the daemons and clients of Debian's slurm-wlm
DAEMONS = ("munged", "slurmctld", "slurmd")


def missing_tools() -> list[str]:
    """The programs this cluster needs that are not installed."""
    need = ["munged", "munge", "slurmctld", "slurmd", "sinfo", "sbatch", "squeue", "scontrol", "scancel", "srun"]
    return [t for t in need if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]


def install() -> str | None:
    """Install Debian's Slurm and munge when missing; None when ready, else why not."""
    if not missing_tools():
        return None
    if os.geteuid() != 0:
        return (f"needs Debian's slurm-wlm and munge ({', '.join(missing_tools())} missing; as root: "
                f"apt-get install {' '.join(PACKAGES)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            return f"{' '.join(cmd)} failed: {r.stderr.strip()[-500:]}"
    return None if not missing_tools() else f"still missing after apt-get: {', '.join(missing_tools())}"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurm:
    """munged + slurmctld + slurmd on this machine, from a folder of their own."""

    def __init__(self, root: str | os.PathLike | None = None, cpus: int | None = None):
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="workbench-slurm-"))
        self._own_root = root is None
        self.cpus = cpus or os.cpu_count() or 1
        self.node = "wbnode"
        self.procs: dict[str, subprocess.Popen] = {}

    # -- files ------------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, submitit) needs in its environment to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _write(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged: every folder above its socket must be searchable by all
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(exist_ok=True)
        (self.root / "munge").chmod(0o755)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        ctl_port, d_port = _free_ports(2)
        user = os.environ.get("USER") or ("root" if os.geteuid() == 0 else str(os.geteuid()))
        r = self.root
        lines = [
            "ClusterName=workbench",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            f"SlurmdPort={d_port}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}" if os.geteuid() != 0 else "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1",  # quick turnaround for short test jobs
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "MinJobAge=600",  # finished jobs stay visible to `scontrol show job` (no accounting here)
            "KillWait=5",
            "MessageTimeout=20",
            f"NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} "
            f"CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    # -- processes --------------------------------------------------------------------------------
    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        env = {**os.environ, **self.env()}
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def start(self, timeout_s: float = 60.0) -> "LocalSlurm":
        """Write the configuration, start the three daemons, wait until the node is idle."""
        self._write()
        m = self.root / "munge"
        self._start("munged", [_sbin("munged"), "-F", f"--key-file={m / 'munge.key'}",
                               f"--socket={self.munge_socket}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), 10, "munged did not create its socket")
        self._start("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._start("slurmd", [_sbin("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(self.idle, timeout_s, "the node did not become idle")
        return self

    def idle(self) -> bool:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True,
                           env={**os.environ, **self.env()}, timeout=20)
        return r.returncode == 0 and r.stdout.strip() == "idle"

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{what}: {', '.join(dead)} exited\n{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"{what} in {timeout_s:.0f} s\n{self.logs()}")

    def logs(self, lines: int = 15) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f}\n" + "\n".join(text))
        return "\n".join(out)

    def cancel_jobs(self, timeout_s: float = 60.0) -> None:
        """Cancel every job of this (private) cluster and wait until none is left, so that no
        job's processes outlive the daemons (slurmstepd keeps running without slurmd). A job
        Slurm cannot cancel in time (one still being launched on a loaded machine refuses
        signals for a while) has its processes killed by pid, as ``scontrol listpids`` names them."""
        env = {**os.environ, **self.env()}
        if any(self.procs.get(n) is None or self.procs[n].poll() is not None for n in ("slurmctld", "slurmd")):
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            r = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, env=env, timeout=20)
            ids = r.stdout.split()
            if r.returncode != 0 or not ids:
                return
            subprocess.run(["scancel", *ids], capture_output=True, env=env, timeout=20)
            time.sleep(1)
        r = subprocess.run(["scontrol", "listpids"], capture_output=True, text=True, env=env, timeout=20)
        for line in r.stdout.splitlines()[1:]:
            pid = line.split()[0] if line.split() else ""
            if pid.isdigit():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(2)  # the step daemons see their tasks end and leave

    def stop(self) -> None:
        """Cancel the jobs, stop what start() started (by pid, munged last), remove the folder."""
        try:
            self.cancel_jobs()
        except (OSError, subprocess.SubprocessError):
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "LocalSlurm":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Start a one-node Slurm cluster here until Ctrl-C.")
    ap.add_argument("--install", action="store_true", help="apt-get install Debian's Slurm and munge if missing")
    args = ap.parse_args(argv)
    why = install() if args.install else (None if not missing_tools() else
                                            f"missing: {', '.join(missing_tools())} (run with --install as root)")
    if why:
        print(f"slurm-test: {why}", file=sys.stderr)
        return 2
    def interrupt(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM):  # once: a second one must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # `kill PID` stops it as cleanly as Ctrl-C
        signal.signal(sig, interrupt)
    with LocalSlurm() as cluster:
        print(f"slurm-test: one node ({cluster.cpus} CPUs, partition debug) is up; in another shell:\n"
              f"  export SLURM_CONF={cluster.conf}\n"
              f"  sinfo; workbench sweep tests/cluster/toy.yaml --executor slurm --jobs 4 --gpus-per-job 0 "
              f"--results /tmp/toy\n"
              f"slurm-test: logs in {cluster.root / 'log'}; Ctrl-C stops the cluster", flush=True)
        try:
            while all(p.poll() is None for p in cluster.procs.values()):
                time.sleep(1)
            print(f"slurm-test: a daemon exited\n{cluster.logs()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("slurm-test: stopping", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
