"""Configuration of the all-gather: variants, dtypes, tiles and grid, and the
``variant="auto"`` table measured on H200s."""
from __future__ import annotations

import torch
import triton

VARIANTS = ("triton", "gluon", "copy_engine", "nccl", "auto")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64)
TILE_ELEMS = {"triton": 8192, "gluon": 8192}  # elements per tile when `block` is not given
NUM_WARPS = 8

# variant="auto": (world_size, largest bytes per rank, variant, num_sms); first match wins; world size 0
# matches any. From results/all_gather/summary.csv (4 H200s, NVLink, eager calls, the slower of the
# median call and the loop average): SM kernels up to 32 MiB at world 2 and 8 MiB at world 4 (at 32 MiB
# per rank the copy engines tie with them at world 4); copy engines above, where they reach 96-98% of
# the peer copy bandwidth against 89-91% for SM stores. NCCL was never the fastest from 2 to 512 MiB.
# World sizes other than 2 and 4 were not measured: they take the world-4 rule.
AUTO_TABLE: list[tuple[int, int, str, int | None]] = [
    (2, 64 << 20, "triton", None),
    (2, 1 << 62, "copy_engine", None),
    (0, 16 << 20, "triton", None),
    (0, 1 << 62, "copy_engine", None),
]




def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _vec(n_cols: int, esize: int) -> int:
    """Elements per 16-byte vector that divide every row (1 if rows are odd)."""
    v = max(1, 16 // esize)
    while v > 1 and n_cols % v:
        v //= 2
    return v


def pick_config(M: int, N: int, esize: int, variant: str, block=None, num_sms=None, world_size=1,
                device_sms: int | None = None, num_warps: int | None = None) -> dict:
    """Tile, vector width, warps and grid for one call (all knobs resolved)."""
    vec = _vec(N, esize)
    if block is not None:
        try:
            block_m, block_n = (int(b) for b in block)
        except (TypeError, ValueError):
            raise ValueError(f"block must be (BLOCK_M, BLOCK_N), got {block!r}") from None
        for name, b in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
            if b < 1 or b & (b - 1):
                raise ValueError(f"{name} must be a power of two, got {b}")
    else:
        tile = TILE_ELEMS.get(variant, 8192)
        block_n = min(_pow2_floor(tile), triton.next_power_of_2(N))
        if N % block_n and N > block_n:  # prefer a width that divides N (no column mask)
            b = block_n
            while b > vec and N % b:
                b //= 2
            if N % b == 0 and b * 4 >= block_n:
                block_n = b
        block_m = max(1, min(triton.next_power_of_2(M), tile // block_n))
    vec = min(vec, block_n)
    tile_elems = block_m * block_n
    if num_warps is None:
        num_warps = _pow2_floor(max(1, min(NUM_WARPS, tile_elems // (32 * vec))))
    elif num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps!r}")
    tiles = -(-M // block_m) * -(-N // block_n)
    sms = num_sms if num_sms is not None else (device_sms or 4)
    if not isinstance(sms, int) or sms < 1:
        raise ValueError(f"num_sms must be a positive integer, got {num_sms!r}")
    grid = min(sms, tiles)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "VEC": vec, "EVEN_N": N % block_n == 0,
            "num_warps": num_warps, "grid": grid, "tiles": tiles}


def _validate(x: torch.Tensor, heap, variant: str):
    if variant not in VARIANTS:
        raise ValueError(f"all_gather: unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"all_gather: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"all_gather: x must have at least one dimension and one element, got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"all_gather: dtype {x.dtype} is not supported (supported: "
                         f"{', '.join(str(d).replace('torch.', '') for d in DTYPES)})")
    if not x.is_contiguous():
        raise ValueError(f"all_gather: x (shape {tuple(x.shape)}, strides {x.stride()}) must be contiguous; "
                         "pass x.contiguous()")
    if x.device.type != heap.device.type or (x.device.type == "cuda" and x.device != heap.device):
        raise ValueError(f"all_gather: x is on {x.device} but the heap of rank {heap.rank} is on {heap.device}")
    if x.numel() * heap.world_size >= 2 ** 62:
        raise ValueError("all_gather: message too large")


def auto_choice(world_size: int, nbytes: int) -> tuple[str, int | None]:
    """(variant, num_sms) that ``variant="auto"`` uses for ``nbytes`` per rank."""
    for ws, limit, variant, sms in AUTO_TABLE:
        if ws in (0, world_size) and nbytes <= limit:
            return variant, sms
    return "triton", None


