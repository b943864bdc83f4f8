"""Probe: one MXFP4 down-projection call at a model's shapes, run a few times: a profiler's target.

    ncu --clock-control none --kernel-name regex:_moe_mxfp4 --launch-skip 3 --launch-count 1 \
        python experiments/probes/run_one_moe_mxfp4.py 4 --config '{"LOAD_AHEAD": 0}'
    ncu --set full --import-source yes --kernel-name regex:_moe_mxfp4 --launch-skip 3 --launch-count 1 \
        python experiments/probes/run_one_moe_mxfp4.py 12 --model gpt-oss-120b

Random MXFP4 weights (KIMI-K2.5 by default: 385 experts, hidden 7168, intermediate 512;
--model gpt-oss-120b / gpt-oss-20b: 128 / 32 experts, 2880, 2880, top-4) prepacked as a model
loader would (``prepare_weights``, --level), random top-k routing of M tokens, bf16
activations; the config as JSON (MoeMxfp4Config fields replacing the prepacked default's;
omitted: the default), ``--iters`` calls, then one check against an fp32 reference of the
first ``--check-tokens`` tokens so a profile of a wrong kernel does not go unnoticed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MAX_CONFIG_CHARS = 2000  # the --config string is parsed as JSON, never evaluated
MODELS = {"kimi-k2.5": (385, 7168, 512, 9), "gpt-oss-120b": (128, 2880, 2880, 4), "gpt-oss-20b": (32, 2880, 2880, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("M", type=int, help="tokens")
    ap.add_argument("--config", default="", help="JSON dict of MoeMxfp4Config fields over the default")
    ap.add_argument("--level", type=int, default=2, choices=(0, 1, 2, 3), help="weight layout (prepare_weights)")
    ap.add_argument("--model", default="kimi-k2.5", choices=sorted(MODELS), help="the layer's shapes")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--check-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    if len(args.config) > MAX_CONFIG_CHARS:
        raise SystemExit(f"--config is longer than {MAX_CONFIG_CHARS} characters")
    fields = json.loads(args.config) if args.config else {}
    if not isinstance(fields, dict):
        raise SystemExit("--config must be a JSON object of MoeMxfp4Config fields, e.g. '{\"LOAD_AHEAD\": 0}'")

    import torch

    from kernels.moe_mxfp4 import (block_m_for, config_for_block_m, dequantize_mxfp4, moe_mxfp4_down,
                                   prepare_routing, prepare_weights, quantize_mxfp4)

    if not torch.cuda.is_available():
        raise SystemExit("run_one_moe_mxfp4 needs a CUDA GPU (sm_90: H100 or H200)")
    E, H, I, TOP_K = MODELS[args.model]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.empty(E, H, I // 2, dtype=torch.uint8, device="cuda")
    ws = torch.empty(E, H, I // 32, dtype=torch.uint8, device="cuda")
    for e0 in range(0, E, 16):                      # chunk by chunk: bounded fp32 temporaries
        e1 = min(E, e0 + 16)
        w[e0:e1], ws[e0:e1] = quantize_mxfp4(torch.randn(e1 - e0, H, I, device="cuda", generator=g) * 0.02)
    weights = prepare_weights(w, ws, args.level)
    M = args.M
    ids = torch.rand(M, E, device="cuda", generator=g).topk(TOP_K, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, TOP_K, device="cuda", generator=g), -1)
    a = torch.randn(M * TOP_K, I, device="cuda", generator=g).bfloat16()
    bm = fields.get("BLOCK_M", block_m_for(M, TOP_K, E))
    cfg = config_for_block_m(bm, I, prepacked=args.level, H=H).replace(**fields)
    routing = prepare_routing(ids, wts, E, bm)
    for _ in range(args.iters):
        out = moe_mxfp4_down(a, weights, routing=routing, config=cfg)
    torch.cuda.synchronize()

    t = min(args.check_tokens, M)
    sel = ids[:t].reshape(-1).long()
    w_f = dequantize_mxfp4(w[sel], ws[sel])                                   # [t * TOP_K, H, I]
    y = torch.einsum("ph,pnh->pn", a[: t * TOP_K].float(), w_f) * wts[:t].reshape(-1, 1)
    ref = y.view(t, TOP_K, H).sum(1)
    err = float((out[:t].float() - ref).norm() / ref.norm())
    print(f"M={M} {cfg.label()} rel_err {err:.2e}")
    return 0 if err < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
