"""One rank of a sweep's multi-GPU world.

``workbench.sweep`` starts ``python -m workbench.sweep_rank PLAN.json`` under
torchrun (through ``workbench.dist.launch``), one world per world size; each
rank runs the plan's points in order and rank 0 emits one row per point.
"""
import sys

from workbench import dist  # noqa: F401  (first: NVLink multicast off before anything initializes)
from workbench.sweep import _rank_main

if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
