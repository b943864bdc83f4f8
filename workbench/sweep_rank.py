"""One rank of a sweep's multi-GPU world.

``workbench.sweep`` starts ``python -m workbench.sweep_rank PLAN.json`` under
torchrun (through ``workbench.dist.launch``), one world per world size; each
rank runs the plan's points in order and rank 0 emits one row per point.
"""
import json
import sys
import time
from pathlib import Path

from workbench import dist  # first: NVLink multicast off before anything initializes
from workbench.spec import load_kernel_module
from workbench.sweep_point import Job, PointRunner, SweepAborted, WorldComm, point_from_json


def main(argv: list[str]) -> int:
    """The plan's points in order through the single process's per-point code; rank 0 emits the rows."""
    plan = json.loads(Path(argv[0]).read_text())
    for entry in reversed(plan.get("sys_path") or []):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    module = load_kernel_module(plan["kernel"], None)  # before the heartbeat: imports are not a point's stage
    job = Job.from_plan(plan, module)
    tasks = [(point_from_json(d), int(rep)) for d, rep in plan["tasks"]]
    deadline_at = plan.get("deadline_at")

    import torch.distributed as tdist

    with dist.worker(plan.get("backend")) as w:
        runner = PointRunner(job, WorldComm(w, tdist.new_group(backend="gloo")))
        for i, (p, rep) in enumerate(tasks):
            row = runner.run(p, rep, where=f"point {i + 1}/{len(tasks)}")
            if w.rank == 0:
                w.emit(row)
            if runner.aborted:
                raise SweepAborted(f"rank {w.rank}: {runner.aborted}")
            if deadline_at is not None and any(runner.comm.gather(time.time() > deadline_at)):
                break
        w.stage("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
