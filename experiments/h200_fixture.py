"""Compile and run the remote-store kernel on a real H200, keeping its cache.

Run on an H200 node:
    PYTHONPATH=. python3 experiments/h200_fixture.py /tmp/h200_fixture
then unpack /tmp/h200_fixture/h200_cache.tar.gz into tests/fixtures/h200_cache/.
It checks the copy is exact, and records cuobjdump's SASS and resource usage
of the same cubin so the CPU tests can compare against them.
"""
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

out = Path(sys.argv[1])
cache = Path(tempfile.mkdtemp())
os.environ["TRITON_CACHE_DIR"] = str(cache)

import torch  # noqa: E402

from kernels.comm.remote import remote_store_kernel  # noqa: E402

n, block = 1 << 20, 2048
for hint in (False, True):
    src = torch.randn(n, device="cuda", dtype=torch.float16)
    dst = torch.full((n,), float("nan"), device="cuda", dtype=torch.float16)
    # One GPU: "rank 0" owns src's heap, "peer 1" owns dst's; translate moves src offsets onto dst.
    bases = torch.tensor([src.data_ptr(), dst.data_ptr()], device="cuda", dtype=torch.int64)
    remote_store_kernel[(n // block,)](bases, src, n, rank=0, peer=1, BLOCK=block, HINT=hint, num_warps=4)
    torch.cuda.synchronize()
    assert torch.equal(src, dst), f"hint={hint}: copy is wrong"
    print(f"hint={hint}: copy exact")

for cubin in cache.glob("*/*.cubin"):
    for flag, suffix in (("-sass", ".cuobjdump_sass"), ("-res-usage", ".cuobjdump_res")):
        res = subprocess.run(["cuobjdump", flag, str(cubin)], capture_output=True, text=True)
        (out / (cubin.parent.name + suffix)).write_text(res.stdout + res.stderr)
with tarfile.open(out / "h200_cache.tar.gz", "w:gz") as tar:
    for d in cache.iterdir():
        if any(p.suffix == ".cubin" for p in d.iterdir()):
            tar.add(d, arcname=d.name)
print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)
subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem", "--format=csv"])
