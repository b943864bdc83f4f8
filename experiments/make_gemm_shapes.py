"""Write the GEMM shape zoo, experiments/gemm_shapes.yaml (deterministic: rerun it and
the file comes out the same).

    python experiments/make_gemm_shapes.py            # writes experiments/gemm_shapes.yaml
    python experiments/make_gemm_shapes.py --check    # exit 1 if the committed file differs

Half the bf16 shapes are the linear layers of real models (weights as B, K x N;
activations as A, M x K) at M in {1, 8, ..., 16384}; half are irregular, drawn from
a seeded generator (log-uniform sizes: M in [1, 16384], N and K in [64, 16384];
tall-skinny, short-wide, just past a tile edge; N and K not multiples of 8 one
time in five). fp16 and fp32 subsets repeat some of them.

Then the region shapes (their own seeded generator, so the rows above never change): the
classes of problem the cold rule keys apart (``kernels.gemm.cold.shape_class``), each with both
halves: large unaligned problems (M, N, K >= 1024, 16-bit, fp16 and bf16; the rows of A, of B and
C, or of both not multiples of 8 elements; B row-major or a transposed view, so that C's rows
alone are unaligned too), narrow N with tall M (N <= 1024, M >= 4096), and long K with small M
and N (K >= 8192, fewer 128x128 tiles than SMs), narrow N with unaligned rows (``region/narrow-pad``:
B's and C's, or A's), unaligned rows with some size under 1024 outside those classes
(``region/midpad-*``), small M with long K but many tiles (``region/widelongk``), plus the shapes
issue 43 named. All of them carry ``group: regions`` (``workbench tune gemm --where group=regions``
tunes them alone; ``--where source=region/narrow-pad`` one kind).

Split: a shape is held out (never seen while fitting the heuristic) when the
SHA-256 of "MxNxK" (decimal, e.g. "16x4096x4096") read as an integer is odd; the
others are the fit half. The dtype is not part of the key, so a shape and its fp16
twin land in the same half.
"""
from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).with_name("gemm_shapes.yaml")
SEED = 14
M_VALUES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MAX_FLOP = 4e12  # keeps one timed call under ~6 ms on an H200
N_REAL = 48
N_IRREGULAR = 48

# (model, layer, N, K): B is the weight, K x N (fused projections where the model fuses them).
LAYERS = [
    ("llama3-8b", "qkv_proj", 6144, 4096), ("llama3-8b", "o_proj", 4096, 4096),
    ("llama3-8b", "gate_up_proj", 28672, 4096), ("llama3-8b", "down_proj", 4096, 14336),
    ("llama3-8b", "lm_head", 128256, 4096),
    ("llama3-70b", "qkv_proj", 10240, 8192), ("llama3-70b", "o_proj", 8192, 8192),
    ("llama3-70b", "gate_up_proj", 57344, 8192), ("llama3-70b", "down_proj", 8192, 28672),
    ("mixtral-8x7b", "expert_w1", 14336, 4096), ("mixtral-8x7b", "expert_w2", 4096, 14336),
    ("mixtral-8x7b", "router", 8, 4096),
    ("qwen2.5-7b", "qkv_proj", 4608, 3584), ("qwen2.5-7b", "o_proj", 3584, 3584),
    ("qwen2.5-7b", "gate_up_proj", 37888, 3584), ("qwen2.5-7b", "down_proj", 3584, 18944),
    ("qwen3-8b", "gate_up_proj", 24576, 4096), ("qwen3-8b", "down_proj", 4096, 12288),
    ("qwen3-30b-a3b", "expert_gate_up", 1536, 2048), ("qwen3-30b-a3b", "expert_down", 2048, 768),
    ("deepseek-v3", "q_a_proj", 1536, 7168), ("deepseek-v3", "kv_a_proj", 576, 7168),
    ("deepseek-v3", "q_b_proj", 24576, 1536), ("deepseek-v3", "kv_b_proj", 32768, 512),
    ("deepseek-v3", "o_proj", 7168, 16384), ("deepseek-v3", "dense_gate_up", 36864, 7168),
    ("deepseek-v3", "dense_down", 7168, 18432),
    ("gpt-oss-120b", "qkv_proj", 5120, 2880), ("gpt-oss-120b", "o_proj", 2880, 4096),
    ("gpt-oss-120b", "expert_gate_up", 5760, 2880), ("gpt-oss-120b", "expert_down", 2880, 2880),
    ("gpt-oss-120b", "router", 128, 2880),
]


def held_out(M: int, N: int, K: int) -> bool:
    """The split rule (see the module docstring)."""
    return int(hashlib.sha256(f"{M}x{N}x{K}".encode()).hexdigest(), 16) % 2 == 1


def _flop(M, N, K) -> float:
    return 2.0 * M * N * K


def real_shapes() -> list[dict]:
    """N_REAL (layer, M) pairs: the layers in turn, each at the next M of a rotation
    (so every M appears several times), skipping pairs over MAX_FLOP."""
    out, seen = [], set()
    i = 0
    while len(out) < N_REAL:
        model, layer, N, K = LAYERS[i % len(LAYERS)]
        M = M_VALUES[(i * 5) % len(M_VALUES)]
        i += 1
        if _flop(M, N, K) > MAX_FLOP or (M, N, K) in seen:
            continue
        seen.add((M, N, K))
        out.append({"M": M, "N": N, "K": K, "source": f"{model}/{layer}"})
    return out


def _loguniform(rng: random.Random, lo: int, hi: int) -> int:
    import math

    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _align(rng: random.Random, x: int) -> int:
    """A multiple of 8 four times in five (what TMA needs of N and K), else x as drawn."""
    if rng.random() < 0.2:
        return x
    return max(8, x - x % 8)


def irregular_shapes(seen: set) -> list[dict]:
    rng = random.Random(SEED)
    out = []
    kinds = ["loguniform"] * 24 + ["tall_skinny"] * 8 + ["short_wide"] * 8 + ["tile_edge"] * 8
    for kind in kinds:
        while True:
            if kind == "loguniform":
                # M over the whole range; N and K from 64 up (a weight narrower than that is not a GEMM's job)
                M, N, K = _loguniform(rng, 1, 16384), _loguniform(rng, 64, 16384), _loguniform(rng, 64, 16384)
            elif kind == "tall_skinny":
                M, N, K = rng.randint(4096, 16384), _loguniform(rng, 1, 256), _loguniform(rng, 64, 8192)
            elif kind == "short_wide":
                M, N, K = _loguniform(rng, 1, 256), rng.randint(2048, 16384), rng.randint(1024, 16384)
            else:  # 1-3 waves of 128x256 tiles on 132 SMs, one row/column of tiles barely used
                M = 128 * rng.randint(4, 24) + rng.randint(1, 16)
                N = 256 * rng.randint(4, 24) + rng.randint(1, 64)
                K = rng.randint(512, 8192)
            N, K = _align(rng, N), _align(rng, K)
            if _flop(M, N, K) <= MAX_FLOP and (M, N, K) not in seen:
                break
        seen.add((M, N, K))
        out.append({"M": M, "N": N, "K": K, "source": f"irregular/{kind}"})
    return out


# --------------------------------------------------------------------------
# Region shapes (issue 43): the classes the cold rule keys apart, both halves of each
# --------------------------------------------------------------------------
SEED_REGIONS = 43
N_BIGPAD = 36     # large unaligned: 12 each with A's rows, B's (and C's) rows, or both unaligned
N_NARROW = 16
N_LONG_K = 16
N_NARROW_PAD = 16  # narrow with unaligned rows: B's and C's (N), or A's (K) one time in four
N_MID_PAD = 32     # unaligned rows, some size under 1024, neither narrow nor long-K (ours 1.6-3.3x cuBLAS on 12 drawn)
N_WIDE_LONG_K = 8  # M <= 512, K >= 8192, but 132+ 128x128 tiles (not the long-K class)
SMS = 132
# (M, N, K, dtype, b, class): the shapes issue 43's user timed (ours well ahead of cuBLAS on the
# unaligned ones, behind on the narrow and long-K ones)
NAMED = [(8191, 8193, 1000, "bfloat16", "row", "unaligned"), (4500, 4500, 4500, "float16", "row", "unaligned"),
         (13955, 632, 3464, "bfloat16", "row", "narrow"), (9000, 1000, 3000, "bfloat16", "row", "narrow"),
         (768, 768, 49152, "bfloat16", "row", "longk")]


def _misalign(rng: random.Random, x: int) -> int:
    """x moved to a size that is not a multiple of 8 (1-7 past the multiple below it)."""
    return x - x % 8 + rng.randint(1, 7)


def bigpad_shapes(rng: random.Random, seen: set) -> list[dict]:
    out = []
    for i in range(N_BIGPAD):
        which = ("a", "bc", "both")[i % 3]     # whose rows are unaligned: A (K), B and C (N), or all
        while True:
            M, N, K = (_loguniform(rng, 1024, 16384) for _ in range(3))
            N = _misalign(rng, N) if which in ("bc", "both") else N - N % 8
            K = _misalign(rng, K) if which in ("a", "both") else K - K % 8
            if _flop(M, N, K) <= MAX_FLOP and (M, N, K) not in seen:
                break
        seen.add((M, N, K))
        # B a transposed view one time in three: then K's rows are A's and B's, N's C's alone
        b = "t" if i % 9 in (1, 5, 6) else "row"
        row = {"M": M, "N": N, "K": K, "source": f"region/bigpad-{which}", "dtype": ("bfloat16", "float16")[i % 2],
               "group": "regions"}
        if b == "t":
            row["b"] = "t"
        out.append(row)
    return out


def narrow_shapes(rng: random.Random, seen: set) -> list[dict]:
    out = []
    for i in range(N_NARROW):
        while True:
            M, N, K = rng.randint(4096, 16384), _align(rng, _loguniform(rng, 64, 1024)), _align(rng, _loguniform(
                rng, 256, 8192))
            if N <= 1024 and _flop(M, N, K) <= MAX_FLOP and (M, N, K) not in seen:
                break
        seen.add((M, N, K))
        out.append({"M": M, "N": N, "K": K, "source": "region/narrow",
                    "dtype": "float16" if i % 4 == 3 else "bfloat16", "group": "regions"})
    return out


def long_k_shapes(rng: random.Random, seen: set) -> list[dict]:
    out = []
    for i in range(N_LONG_K):
        while True:
            M, N = _loguniform(rng, 65, 1536), _loguniform(rng, 64, 1536) // 8 * 8 or 8
            K = _loguniform(rng, 8192, 65536) // 8 * 8
            few_tiles = -(-M // 128) * -(-N // 128) < SMS
            if few_tiles and _flop(M, N, K) <= MAX_FLOP and (M, N, K) not in seen:
                break
        seen.add((M, N, K))
        out.append({"M": M, "N": N, "K": K, "source": "region/longk",
                    "dtype": "float16" if i % 4 == 3 else "bfloat16", "group": "regions"})
    return out


def narrow_pad_shapes(rng: random.Random, seen: set) -> list[dict]:
    """Narrow N with tall M whose rows are not 16-byte multiples (the fit half had few: cuBLAS ran
    2.5x behind our padded kernel on held-out ones with N 69 and 76 and K in the thousands)."""
    out = []
    for i in range(N_NARROW_PAD):
        while True:
            M, N, K = rng.randint(4096, 16384), _loguniform(rng, 9, 1024), _loguniform(rng, 256, 16384)
            if i % 4 == 3:
                N, K = max(8, N - N % 8), _misalign(rng, K)
            else:
                N, K = _misalign(rng, N), K - K % 8
            if N <= 1024 and _flop(M, N, K) <= MAX_FLOP and (M, N, K) not in seen:
                break
        seen.add((M, N, K))
        out.append({"M": M, "N": N, "K": K, "source": "region/narrow-pad",
                    "dtype": "float16" if i % 2 else "bfloat16", "group": "regions"})
    return out


def mid_pad_shapes(rng: random.Random, seen: set) -> list[dict]:
    """16-bit problems whose rows are not 16-byte multiples, outside the large-unaligned, narrow and
    long-K classes (some size under 1024): the general regions had few fit points of them and one
    refit sent them to cuBLAS, 1.6-3.3x behind our padded kernels on 12 such shapes drawn to check it."""
    out = []
    for i in range(N_MID_PAD):
        which = ("a", "bc", "both")[i % 3]
        while True:
            M, N, K = _loguniform(rng, 512, 16384), _loguniform(rng, 128, 8192), _loguniform(rng, 128, 8192)
            N = _misalign(rng, N) if which in ("bc", "both") else N - N % 8
            K = _misalign(rng, K) if which in ("a", "both") else K - K % 8
            narrow = N <= 1024 and M >= 4096
            if min(M, N, K) < 1024 and not narrow and _flop(M, N, K) <= MAX_FLOP and (M, N, K) not in seen:
                break
        seen.add((M, N, K))
        out.append({"M": M, "N": N, "K": K, "source": f"region/midpad-{which}",
                    "dtype": ("bfloat16", "float16")[i % 2], "group": "regions"})
    return out


def wide_long_k_shapes(rng: random.Random, seen: set) -> list[dict]:
    """Small M, long K, but too many 128x128 tiles for the long-K class (N of thousands): the general
    region they fall in had fit points of the long-K class alone."""
    out = []
    for i in range(N_WIDE_LONG_K):
        while True:
            M, N, K = rng.randint(65, 512), 128 * rng.randint(32, 128), 64 * rng.randint(128, 400)
            if -(-M // 128) * -(-N // 128) >= SMS and _flop(M, N, K) <= MAX_FLOP and (M, N, K) not in seen:
                break
        seen.add((M, N, K))
        out.append({"M": M, "N": N, "K": K, "source": "region/widelongk",
                    "dtype": "float16" if i % 4 == 3 else "bfloat16", "group": "regions"})
    return out


def region_shapes(seen: set) -> list[dict]:
    rng = random.Random(SEED_REGIONS)
    named = []
    for M, N, K, dtype, b, what in NAMED:
        seen.add((M, N, K))
        named.append({"M": M, "N": N, "K": K, "source": f"issue43/{what}", "dtype": dtype, "group": "regions",
                      **({"b": b} if b == "t" else {})})
    return (named + bigpad_shapes(rng, seen) + narrow_shapes(rng, seen) + long_k_shapes(rng, seen)
            + narrow_pad_shapes(rng, seen) + mid_pad_shapes(rng, seen) + wide_long_k_shapes(rng, seen))


def zoo() -> list[dict]:
    real = real_shapes()
    irregular = irregular_shapes({(s["M"], s["N"], s["K"]) for s in real})
    rows = [dict(s, dtype="bfloat16") for s in real + irregular]
    # fp16: every third bf16 shape; fp32 (tf32 tensor cores): every sixth, when small enough
    rows += [dict(s, dtype="float16") for s in (real + irregular)[::3]]
    rows += [dict(s, dtype="float32") for s in (real + irregular)[1::6] if _flop(s["M"], s["N"], s["K"]) <= 1e12]
    rows += region_shapes({(r["M"], r["N"], r["K"]) for r in rows})
    for r in rows:
        r["split"] = "held_out" if held_out(r["M"], r["N"], r["K"]) else "fit"
    return rows


def render(rows: list[dict]) -> str:
    head = ("# GEMM shape zoo: written by experiments/make_gemm_shapes.py (do not edit by hand).\n"
            "# A is M x K (activations), B is K x N (weights), C is M x N; b: t, B is a transposed view\n"
            "# (x @ w.t(): K-major).\n"
            "# split: held_out when int(sha256(f'{M}x{N}x{K}'), 16) is odd, else fit\n"
            "# (the heuristic is fitted on 'fit' rows only).\n")
    return head + yaml.safe_dump({"seed": SEED, "shapes": rows}, sort_keys=False, width=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed file, write nothing")
    args = ap.parse_args(argv)
    text = render(zoo())
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("gemm_shapes.yaml is up to date" if same else "gemm_shapes.yaml differs from the generator")
        return 0 if same else 1
    OUT.write_text(text)
    rows = zoo()
    print(f"wrote {OUT} ({len(rows)} shapes: "
          + ", ".join(f"{d} {sum(r['dtype'] == d for r in rows)}" for d in ("bfloat16", "float16", "float32"))
          + f"; held out {sum(r['split'] == 'held_out' for r in rows)}; region shapes "
          + ", ".join(f"{k} {sum(r['source'].startswith(f'region/{k}') for r in rows)}"
                      for k in ("bigpad", "narrow", "longk", "narrow-pad", "midpad", "widelongk")) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
