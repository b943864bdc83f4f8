"""An instruction-level model of the inline PTX the MXFP4 kernels expand codes with: the GPU's
paths are checked word by word on the CPU (Triton's interpreter runs no inline assembly)."""
from __future__ import annotations

import numpy as np
import torch


def run_ptx(text: str, regs: dict) -> dict:
    """A model of the few b32 PTX instructions the expansion uses (and, or, shl, shr, prmt in
    the default mode, shf.l.wrap, mad.lo, mov, mul.rn.bf16x2), run over numpy uint32 arrays: $N
    operands come from regs; returns every register by name."""
    env = dict(regs)
    val = lambda t: env[t] if t in env else np.uint32(int(t, 0))
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        v = [val(x) for x in a[1:]]
        if op == "mov.b32":
            r = v[0] + np.zeros_like(next(iter(regs.values())))
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "add.u32":
            r = v[0] + v[1]
        elif op == "mad.lo.u32":              # the low 32 bits of v0 * v1 + v2
            r = np.asarray((v[0].astype(np.uint64) * np.uint64(v[1]) + np.uint64(v[2])) & np.uint64(0xFFFFFFFF),
                           dtype=np.uint32)
        elif op == "not.b32":
            r = ~v[0]
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "shl.b32":
            r = v[0] << v[1]
        elif op == "shf.l.wrap.b32":          # funnel shift of (hi = v[1], lo = v[0]) left by v[2] % 32
            k = np.uint32(int(v[2]) % 32)
            r = (v[1] << k) | (v[0] >> np.uint32(32 - k)) if k else v[1]
        elif op == "mul.rn.bf16x2":           # two bf16 products, each rounded once (torch's CPU bf16 does)
            half = lambda x, i: torch.from_numpy(((x >> np.uint32(16 * i)) & np.uint32(0xFFFF)).astype(np.int32))
            prod = [(half(v[0], i).to(torch.int16).view(torch.bfloat16) * half(v[1], i).to(torch.int16)
                     .view(torch.bfloat16)).view(torch.int16).to(torch.int32).numpy().astype(np.uint32) & 0xFFFF
                    for i in (0, 1)]
            r = prod[0] | prod[1] << np.uint32(16)
        elif op == "prmt.b32":                # default mode, selector nibble bit 3 unused here
            pool = [(v[0] >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)] + \
                   [(np.uint32(v[1]) >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
            sel = int(v[2])
            assert all(not (sel >> (4 * i + 3)) & 1 for i in range(4))
            r = sum(pool[(sel >> (4 * i)) & 7] << np.uint32(8 * i) for i in range(4))
        else:
            raise AssertionError(f"unmodelled PTX op {op}")
        env[a[0]] = np.asarray(r, dtype=np.uint32)
    return env
