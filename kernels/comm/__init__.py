"""All-gather over a symmetric heap: every rank pushes its shard to every rank.

The communication family: peer-memory helpers (``kernels.comm.remote``) and
the all-gather.

``all_gather(x, heap)`` returns ``out`` of shape ``(world * x.shape[0], *x.shape[1:])``
with rank r's ``x`` in rows ``r * M : (r + 1) * M`` on every rank (what
``torch.distributed.all_gather_into_tensor`` gives), bit for bit.

Variants (``variant=``):

``"triton"``  persistent, tiled: each program walks tiles ``pid, pid + grid, ...``
              of ``x`` (``BLOCK_M x BLOCK_N``), loads a tile once and stores it
              into every rank's ``out`` at ``dst + kernels.comm.remote.peer_delta(...)``
              (pointer arithmetic; with ``hints`` the distance is asserted
              16-byte aligned, so the stores stay 16 bytes wide).
``"gluon"``   the same walk written in Gluon over a flat 1-D index of the tile
              (row/column by div/mod) with an explicit ``gl.BlockedLayout``
              of ``VEC`` elements per thread (16 bytes), the local heap base
              loaded once before the loop, and destinations staggered
              ``(rank + i) % world`` so ranks do not all write rank 0 first.
``"copy_engine"`` no SMs: one ``cudaMemcpyAsync`` into each peer's heap (in
              turn, on a side stream), then a bounded device barrier (``kernels.comm.barrier``).
``"nccl"``    ``torch.distributed.all_gather_into_tensor`` (the baseline).
``"auto"``    the faster of the above for the message size, from the H200
              measurements in ``AUTO_TABLE``.

Completion: after its last tile every program adds 1 to its slot in every
rank's flag array (data stores, CTA barrier, release atomic at system scope);
program 0 of each rank then waits (acquire, bounded) until every slot reached
the running total of grids launched so far, a total it keeps on the device
(so a CUDA graph of calls replays correctly). A peer that never arrives makes
the wait give up (and, once one wait of a call gave up, the call's other waits with it); the
host raises `kernels.comm.waits.WaitTimeout` naming the rank at the next call (or at
``check_all_gather(heap)``), never synchronizing a call to find out, and once only: the flags
stay in step, so the call after it works on every rank. A rank that arrives after its peers
gave up on the call raises too (``kernels.comm.waits``, rule 4). In a simulated world
the wait is a second launch after ``heap.barrier()`` (ranks take turns in the
interpreter, so no rank may spin inside a kernel while another waits to run).

``out`` lives in the heap and is reused by the next call with the same shape:
copy it, or meet the peers (``kernels.comm.barrier.barrier(heap)``) after reading, before
gathering into it again.

Parts: ``remote`` (device-side peer helpers, flag protocol), ``waits`` (bounded waits, what a
call does when one gives up, ``StatusWatch``), ``barrier`` (a bounded barrier of every rank),
``triton`` / ``gluon`` (kernels), ``config`` (tiles, grid, auto table),
``launch`` (``all_gather``), ``reference``, ``baselines`` (NCCL), ``metrics``
(bus bandwidth) and ``sweep`` (the ``workbench sweep`` protocol).
"""
from kernels.comm.config import AUTO_TABLE, VARIANTS, auto_choice, pick_config
from kernels.comm.launch import all_gather, check_all_gather, out_buffer
from kernels.comm.metrics import bus_bandwidth_gbps
from kernels.comm.reference import reference
from kernels.comm.barrier import barrier, check_barrier
from kernels.comm.waits import WaitTimeout

__all__ = ["AUTO_TABLE", "VARIANTS", "WaitTimeout", "all_gather", "auto_choice", "barrier", "bus_bandwidth_gbps",
           "check_all_gather", "check_barrier", "out_buffer", "pick_config", "reference"]
