"""Which line of my kernel stalls? Nsight Compute's counters per source line.

- `run` (``workbench profile run``, a GPU node with ncu): profile one kernel
  launch; the report, a JSON summary naming the Triton cache entry, the log.
- `report` (CPU, no ncu): `load(path)` reads one kernel of a report through
  NVIDIA's ``ncu-report`` package, bounded, in a child process (`reader`).
- `lines`: the counters per SASS instruction and per source line, joined with
  the inspector's attribution (`workbench.asm.lines`): inlined helpers keep
  their own line and call sites.
- `inspector`: the columns ``asm lines --counters`` and ``asm diff --by-line
  --counters`` add; `html`: the source coloured by stall share (notebooks,
  reports, the ISA diff widget's source pane); `cli`: ``workbench profile``.
"""
from .report import KernelProfile, ProfileError, load

__all__ = ["KernelProfile", "ProfileError", "load"]
