"""A side stream for copy-engine work, forked from and joined to the caller's stream
with two events made once (per plan), not per call.

``torch.cuda.Stream.wait_stream`` records a new event on every call, and the
``torch.cuda.stream(...)`` context manager looks up and sets streams on entry and
exit; in a launcher called thousands of times those are host time spent on every
call. Reusing the two events is safe: ``cudaStreamWaitEvent`` waits for the work the
event captured when it was recorded, and a later record does not change an earlier
wait (also under CUDA-graph capture, where each record/wait pair becomes an edge).
"""
from __future__ import annotations

import torch


class SideStream:
    """``fork(cur)``: the side stream waits for everything queued on ``cur`` so far and
    becomes the current stream; ``leave(cur)``: marks where the side stream's work ends and
    makes ``cur`` current again (work queued on ``cur`` after this still overlaps the side
    stream's); ``join(cur)``: ``cur`` waits for the side stream's work up to that mark."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)
        self._forked = torch.cuda.Event()
        self._done = torch.cuda.Event()

    def fork(self, cur) -> None:
        self._forked.record(cur)
        self.stream.wait_event(self._forked)
        torch.cuda.set_stream(self.stream)

    def leave(self, cur) -> None:
        self._done.record(self.stream)
        torch.cuda.set_stream(cur)

    def join(self, cur) -> None:
        cur.wait_event(self._done)
