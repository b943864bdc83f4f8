"""Launch configuration of the MXFP4 down-projection: dataclass, validation, heuristic."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .routing import max_rows

__all__ = ["MoeMxfp4Config", "block_m_for", "config_for_block_m", "default_config", "every_part_has_a_step",
           "split_k_for", "with_split_k", "INTERPRET_CONFIG"]

_BLOCK_M = (16, 32, 64, 128)
SPLITS = (1, 2, 3, 4, 6, 8)          # the SPLIT_K values a config may take


def every_part_has_a_step(steps: int, split: int) -> bool:
    """Whether SPLIT_K = split parts of cdiv(steps, split) K steps each leave the last part one at
    least (a ragged split's last part is shorter; an empty one is refused)."""
    return (split - 1) * -(-steps // split) < steps


@dataclass(frozen=True)
class MoeMxfp4Config:
    """One launch configuration.

    BLOCK_M: token rows per tile (the routing must be padded to it); BLOCK_N: output
    columns (hidden) per tile; BLOCK_K: reduction step (intermediate), a multiple of 32.
    NT: evict-first hint on the weight loads. EARLY_LOADS / PREFETCH_EPILOGUE: seed 004's
    two latency-hiding changes. SWAP_AB: compute the transposed tile so that wgmma's
    64-row side is the weights (None: when BLOCK_M < 64). DETERMINISTIC: per-pair
    workspace rows reduced in slot order instead of atomics (same bits every run).
    EXPAND: how E2M1 codes become bf16, "ptx" (inline PTX, two values per 32-bit op) or
    "bits" (Triton integer ops); both exact, the interpreter always uses its own fp32 path.
    LOAD_AHEAD: K steps whose weight, scale and activation loads are issued before the
    current step's expansion and dot (0: one step in flight at a time; 1-3: a rotation of
    register slots keeps up to LOAD_AHEAD + 1 steps in flight per program).
    PREPACK: 0, or the level of ``quant.prepack_mxfp4`` the weights and scales come in (same
    shapes): 1, each 64-row x 128-K tile stored in the order of wgmma's register operand (no
    shared-memory pass before the expansion); 2, also the code bits of each 4-byte register
    group placed so that every bf16x2 pattern is one rotation and one mask (EXPAND="ptx"); 3,
    also the codes of each 128-K tile paired as (K = j, K = 64 + j) instead of (2j, 2j + 1), so
    the low and high nibbles meet two contiguous halves of the bf16 activations (loaded as they
    are) instead of their even and odd columns (a register split; MXFP4 activations are then
    interleaved back into K order, which costs more than level 2 saves). Needs SWAP_AB, 4 warps,
    BLOCK_N % 64 == 0 and BLOCK_K % 128 == 0 (a BLOCK_N that does not divide the prepacked rows, H
    rounded up to 64, reads the 64-row blocks past them as zeros);
    BLOCK_K must divide I rounded up to 128 (what prepack_mxfp4 stores). The launcher runs a PREPACK
    config only on ``Mxfp4Weights`` of that level (``prepare_weights``).
    ONE_MUL (PREPACK only): scale each bf16x2 pattern with one multiply by 2**(s - 1) instead of
    two (x 2**126, then x 2**(s - 127)); exact, and the same bits, only while every scale byte
    is at most 128, so the launcher uses it only where ``prepare_weights`` measured that
    (``Mxfp4Weights.max_scale``) and runs the two multiplies otherwise.
    SPLIT_K: programs per output tile, each reducing cdiv(steps, SPLIT_K) of the K steps and
    adding its partial sums with the atomic epilogue (atomic mode only): more, shorter programs
    where a few tiles per expert would leave the last wave of programs nearly empty. It need not
    divide the steps (gpt-oss' 23: the last part's steps past I read zeros), but every part must
    hold at least one step.
    maxnreg: a register cap per thread (None: the compiler's choice), so that more programs fit
    on an SM (65,536 registers / (32 * num_warps * maxnreg)), at the price of spills.
    N_TILES: column tiles per program, computed one after the other with the routing's ids, expert
    and weights loaded once (the unrolled form only: N_TILES x the K steps are straight-line code).
    The loads ahead run on into the next tile, so its first weights are in flight while the finished
    tile's epilogue (its atomics) runs; N_TILES times fewer programs. The column tiles (H / BLOCK_N,
    rounded up) must divide by it. Each output element gets the same sums as with N_TILES=1.
    UNROLL: the K steps as straight-line code (up to the launcher's MAX_UNROLLED_STEPS), or, False,
    as a loop the compiler may software-pipeline over ``num_stages`` (loads staged through shared
    memory instead of registers; LOAD_AHEAD applies to the unrolled form only).
    """

    BLOCK_M: int = 16
    BLOCK_N: int = 128
    BLOCK_K: int = 128
    num_warps: int = 4
    num_stages: int = 1
    NT: bool = True
    EARLY_LOADS: bool = True
    PREFETCH_EPILOGUE: bool = True
    SWAP_AB: bool | None = None
    DETERMINISTIC: bool = False
    EXPAND: str = "ptx"
    LOAD_AHEAD: int = 0
    PREPACK: int = 0
    ONE_MUL: bool = True
    SPLIT_K: int = 1
    maxnreg: int | None = None
    UNROLL: bool = True
    N_TILES: int = 1

    @property
    def swap_ab(self) -> bool:
        return self.BLOCK_M < 64 if self.SWAP_AB is None else bool(self.SWAP_AB)

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        flags = "".join(f for f, on in (("_nt", self.NT), ("_early", self.EARLY_LOADS),
                                          ("_prefetch", self.PREFETCH_EPILOGUE)) if on)
        mode = "det" if self.DETERMINISTIC else "atomic"
        return (f"bm{self.BLOCK_M}_bn{self.BLOCK_N}_bk{self.BLOCK_K}_w{self.num_warps}_s{self.num_stages}"
                f"{flags}{'_swap' if self.swap_ab else ''}_{mode}{'' if self.EXPAND == 'ptx' else '_' + self.EXPAND}"
                f"{f'_la{self.LOAD_AHEAD}' if self.LOAD_AHEAD else ''}{f'_prepack{self.PREPACK}' if self.PREPACK else ''}"
                f"{'_2mul' if self.PREPACK and not self.ONE_MUL else ''}{f'_sk{self.SPLIT_K}' if self.SPLIT_K > 1 else ''}"
                f"{f'_r{self.maxnreg}' if self.maxnreg else ''}{'' if self.UNROLL else '_loop'}"
                f"{f'_tiles{self.N_TILES}' if self.N_TILES > 1 else ''}")

    def replace(self, **kw) -> "MoeMxfp4Config":
        return replace(self, **kw)

    def validate(self, K: int) -> None:
        """Raise ValueError when this config cannot run a reduction of length K."""
        if self.BLOCK_M not in _BLOCK_M:
            raise ValueError(f"moe_mxfp4: BLOCK_M must be one of {_BLOCK_M}, got {self.BLOCK_M}")
        for name in ("BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"moe_mxfp4: {name} must be a power of two >= 16, got {v}")
        if self.BLOCK_K < 32:
            raise ValueError(f"moe_mxfp4: BLOCK_K must be >= 32 (one scale block), got {self.BLOCK_K}")
        steps = -(-K // self.BLOCK_K)     # the last one reads I's tail (K % BLOCK_K) and zeros past it
        if self.maxnreg is not None and not (isinstance(self.maxnreg, int) and 24 <= self.maxnreg <= 255):
            raise ValueError(f"moe_mxfp4: maxnreg must be None or an int in [24, 255], got {self.maxnreg!r}")
        if self.SPLIT_K not in SPLITS:
            raise ValueError(f"moe_mxfp4: SPLIT_K must be one of {SPLITS}, got {self.SPLIT_K!r}")
        if self.SPLIT_K > 1 and self.DETERMINISTIC:
            raise ValueError("moe_mxfp4: SPLIT_K > 1 adds partial sums with atomics; the deterministic mode "
                             "needs SPLIT_K=1")
        if not every_part_has_a_step(steps, self.SPLIT_K):
            raise ValueError(f"moe_mxfp4: SPLIT_K={self.SPLIT_K} parts of cdiv(I={K}, BLOCK_K={self.BLOCK_K}) = "
                             f"{steps} K steps, {-(-steps // self.SPLIT_K)} each, leave the last part none; "
                             f"use a SPLIT_K with (SPLIT_K - 1) * cdiv(steps, SPLIT_K) < steps")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"moe_mxfp4: num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        if self.EXPAND not in ("ptx", "bits"):
            raise ValueError(f"moe_mxfp4: EXPAND must be 'ptx' or 'bits', got {self.EXPAND!r}")
        if self.LOAD_AHEAD not in (0, 1, 2, 3):
            raise ValueError(f"moe_mxfp4: LOAD_AHEAD must be 0, 1, 2 or 3, got {self.LOAD_AHEAD!r}")
        if not isinstance(self.UNROLL, bool) or (self.LOAD_AHEAD and not self.UNROLL):
            raise ValueError(f"moe_mxfp4: UNROLL must be True or False, and LOAD_AHEAD (a rotation of unrolled "
                             f"steps) needs UNROLL=True; got UNROLL={self.UNROLL!r}, LOAD_AHEAD={self.LOAD_AHEAD}")
        if not isinstance(self.N_TILES, int) or isinstance(self.N_TILES, bool) or not 1 <= self.N_TILES <= 8 \
                or (self.N_TILES > 1 and not self.UNROLL):
            raise ValueError(f"moe_mxfp4: N_TILES must be an int in [1, 8], and N_TILES > 1 (unrolled tiles) needs "
                             f"UNROLL=True; got N_TILES={self.N_TILES!r}, UNROLL={self.UNROLL}")
        if self.PREPACK not in (0, 1, 2, 3):
            raise ValueError(f"moe_mxfp4: PREPACK must be 0, 1, 2 or 3, got {self.PREPACK!r}")
        if self.PREPACK >= 2 and self.EXPAND != "ptx":
            raise ValueError(f"moe_mxfp4: PREPACK={self.PREPACK} needs EXPAND='ptx'")
        if self.PREPACK and not (self.swap_ab and self.num_warps == 4 and self.BLOCK_N % 64 == 0
                                 and self.BLOCK_K % 128 == 0):
            raise ValueError(f"moe_mxfp4: PREPACK needs SWAP_AB, num_warps=4, BLOCK_N % 64 == 0 and "
                             f"BLOCK_K % 128 == 0, got {self.label()}")
        if self.PREPACK and (-(-K // 128) * 128) % self.BLOCK_K:
            raise ValueError(f"moe_mxfp4: prepacked weights hold I={K} as {-(-K // 128)} tiles of 128 (padded); "
                             f"BLOCK_K={self.BLOCK_K} does not divide them: use BLOCK_K=128")
        if self.num_stages < 1:
            raise ValueError(f"moe_mxfp4: num_stages must be >= 1, got {self.num_stages}")


# Tiny tiles for Triton's interpreter (correctness only).
INTERPRET_CONFIG = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=1)


def default_config(M: int, top_k: int, num_experts: int, K: int, *, interpreter: bool = False,
                   deterministic: bool = False, prepacked: int = 0, H: int | None = None,
                   sms: int | None = None) -> MoeMxfp4Config:
    """The heuristic, from host-side sizes only.

    The row tile follows the mean rows per expert, M * top_k / E (KIMI-K2.5: 0.09 at
    M = 4, 6 at M = 256, 383 at M = 16384): BM16 while an expert gets about one tile
    of rows (padding waste stays below a tile, and each weight tile is read once, so
    NT keeps it from evicting the activations), BM32 up to three tiles, then 64 and
    128 rows, where each expanded weight tile serves more rows and NT is off (the row
    blocks of an expert reread its weights from L2). experiments/run_moe_mxfp4.py
    times the alternatives; results/moe_mxfp4/ has the measurements.

    prepacked: the level of the weights' layout (``Mxfp4Weights.level``; 0 = plain). For 1
    to 3 the same row tile, from ``_BY_BLOCK_M_PREPACKED`` (those tiles are also the
    smallest the prepacked layout allows, so ``interpreter`` changes nothing there).

    H and sms (the output columns and the GPU's SMs), when both given: also the SPLIT_K that
    ``moe_mxfp4_down`` picks without a config (``with_split_k``), i.e. exactly what it runs.
    """
    if prepacked:
        cfg = config_for_block_m(block_m_for(M, top_k, num_experts), K, deterministic=deterministic,
                                 prepacked=prepacked, H=H)
        if H is None or sms is None:
            return cfg
        return with_split_k(cfg, max_rows(M * top_k, num_experts, cfg.BLOCK_M) // cfg.BLOCK_M, H, K, sms)
    if interpreter:
        return INTERPRET_CONFIG.replace(BLOCK_K=64 if K % 64 == 0 else 32, DETERMINISTIC=deterministic)
    for max_m, cfg in _BY_M_RANGE:
        if M <= max_m:
            return cfg.replace(DETERMINISTIC=deterministic)
    return config_for_block_m(block_m_for(M, top_k, num_experts), K, deterministic=deterministic)


def block_m_for(M: int, top_k: int, num_experts: int) -> int:
    """The heuristic's row tile (what ``prepare_routing`` pads to): see ``default_config``."""
    per_expert = M * top_k / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64 if per_expert <= 160 else 128


def config_for_block_m(block_m: int, K: int, *, deterministic: bool = False, prepacked: int = 0,
                       H: int | None = None) -> MoeMxfp4Config:
    """The heuristic's config for a given row tile (what the launcher runs for a routing padded to
    block_m when no config is passed); prepacked: the weights' layout level (0 = plain). H (the
    output columns), when given: a prepacked tile wider than 64 columns that does not divide the
    prepacked rows (H rounded up to 64, prepack_mxfp4's padding) falls back to 64 (gpt-oss' 2880).
    Such a tile runs (the kernel masks the 64-row blocks past the stored rows), but at gpt-oss'
    M = 8192 BM128 x BN128 took 3.2 ms against BN64's 2.5 (one H200; results/moe_mxfp4/README.md)."""
    if prepacked:
        if prepacked not in (1, 2, 3):
            raise ValueError(f"moe_mxfp4: prepacked must be 0, 1, 2 or 3, got {prepacked!r}")
        if K % 32:
            raise ValueError(f"moe_mxfp4: prepacked weights need I % 32 == 0, got I={K}")
        cfg = _BY_BLOCK_M_PREPACKED.get(block_m)
        if cfg is None:
            raise ValueError(f"moe_mxfp4: BLOCK_M must be one of {_BLOCK_M}, got {block_m!r}")
        if H is not None and (-(-H // 64) * 64) % cfg.BLOCK_N:     # the prepacked rows: H rounded up to 64
            cfg = cfg.replace(BLOCK_N=64)
        return cfg.replace(PREPACK=prepacked, DETERMINISTIC=deterministic)
    bk = 128
    while K % bk and bk > 32:
        bk //= 2
    cfg = _BY_BLOCK_M.get(block_m)
    if cfg is None:
        raise ValueError(f"moe_mxfp4: BLOCK_M must be one of {_BLOCK_M}, got {block_m!r}")
    return cfg.replace(BLOCK_K=bk, DETERMINISTIC=deterministic)


# The no-config SPLIT_K rule (split_k_for). Rule 1 (split while the output tiles, an upper
# bound, are fewer than SPLIT_PROGRAMS_PER_SM per SM) was chosen after KIMI-K2.5, DeepSeek-V3 and
# Mixtral and scored on Qwen3-235B and Llama-4 Maverick, held out: regret up to 1.26 (it never
# split launches of long programs, which gained 1.03-1.26x from it, and split a 12-step
# reduction that lost 8%). Rule 2, below, fit on those five layers: each program keeps at least
# SPLIT_MIN_STEPS K steps, and programs of SPLIT_LONG_STEPS or more split even in a full launch;
# scored on three more layers held out from it (results/moe_mxfp4/README.md, "SPLIT_K").
SPLIT_PROGRAMS_PER_SM = 8
SPLIT_MIN_STEPS = 8
SPLIT_LONG_STEPS = 32


def split_k_for(max_tiles: int, K: int, block_k: int, sms: int) -> int:
    """The launcher's SPLIT_K without a config (atomic mode), 1, 2 or 4: the cdiv(K, BLOCK_K) steps
    are split in two again (cdiv(steps, parts) each: gpt-oss' 23 in 12 + 11) while each part keeps at least SPLIT_MIN_STEPS steps
    and either the launch has fewer than SPLIT_PROGRAMS_PER_SM programs per SM (``max_tiles``: the routing's row blocks
    times the column tiles, an upper bound) or a program would run SPLIT_LONG_STEPS steps or
    more. KIMI-K2.5 (I = 512: 4 steps) never splits; Mixtral (I = 14336: 112 steps) splits 4."""
    s, total = 1, -(-K // block_k)
    while s < 4:
        steps = -(-total // s)
        if -(-total // (2 * s)) < SPLIT_MIN_STEPS:
            break
        if max_tiles * s >= sms * SPLIT_PROGRAMS_PER_SM and steps < SPLIT_LONG_STEPS:
            break
        s *= 2
    return s


def with_split_k(config: "MoeMxfp4Config", max_blocks: int, H: int, K: int, sms: int) -> "MoeMxfp4Config":
    """config with the SPLIT_K of split_k_for for a launch of max_blocks row blocks (the routing's
    ``max_blocks``) over H output columns on sms SMs; unchanged in the deterministic mode."""
    if config.DETERMINISTIC:
        return config
    tiles = max_blocks * -(-H // config.BLOCK_N)
    return config.replace(SPLIT_K=split_k_for(tiles, K, config.BLOCK_K, sms))


# Column tiles from the first H200 run (results/moe_mxfp4/rows.csv, KIMI-K2.5 shapes): at every
# M from 4 to 256 the BM16 tile ran 6-12% faster 64 columns wide than 128 (twice the CTAs over the
# 7168 output columns: more weight bytes in flight), except M = 16 and 32, where it was within 1-3.5%
# of the best; at M = 16384 BM128 with 256-wide tiles ran 18% faster than 128-wide (0.90x the
# bf16-weight grouped GEMM instead of 0.74x). BM32/BM64 were not the fastest anywhere.
_BY_BLOCK_M = {
    16: MoeMxfp4Config(BLOCK_M=16, BLOCK_N=64, NT=True),
    32: MoeMxfp4Config(BLOCK_M=32, NT=True),
    64: MoeMxfp4Config(BLOCK_M=64, NT=False),
    128: MoeMxfp4Config(BLOCK_M=128, BLOCK_N=256, num_warps=8, NT=False),
}

# Per-M-range overrides of the heuristic, (largest M, config) in increasing M, checked first by
# default_config (not by the launcher's no-config path, which knows only the routing's BLOCK_M
# and uses _BY_BLOCK_M). Empty until measured: experiments/run_moe_mxfp4_variants.py picks a
# config per range (M <= 11, 12-47, 48-191, 192-4095) at M 4, 16, 64, 256 (picks.csv).
_BY_M_RANGE: tuple = ()

# Weights prepacked at level 1, 2 or 3 (quant.prepare_weights; the launcher's no-config path for
# Mxfp4Weights). One layout serves every M, so every row tile needs a PREPACK config: SWAP_AB
# (also at BM64/128, where the plain default does not swap), 4 warps, BLOCK_N 64 (the prepacked rows
# are padded to a multiple of 64, no more), BLOCK_K 128 (I is padded to a multiple of 128). PREPACK is set to the weights' level; the tiles were
# measured at level 2.
# Measured: results/moe_mxfp4/README.md, "Prepacked weights on the H200" (commit efb9efe, one
# H200, graph replay, L2 flushed: `python3 experiments/run_moe_mxfp4_variants.py --budget-s 150
# --m 4 16 64 256`), fit at M 4, 16, 64, 256 only; M 8, 32, 128 and 16384 are held out (to be
# measured: run_moe_mxfp4_variants.py --m 8 32 128 16384 scores these picks there).
_BY_BLOCK_M_PREPACKED = {
    # BM16 BN64 PREPACK=2 LOAD_AHEAD=1: the fastest variant at all four fitted M (33.8, 94.9,
    # 228.4, 290.4 us; 1.54-1.64x the plain default; LOAD_AHEAD=1 1-2% ahead of 0). KIMI-K2.5
    # runs BM16 up to M = 684.
    16: MoeMxfp4Config(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1),
    # BM32 BN64 PREPACK=2: the one BM32 prepacked tile measured (1.23-1.30x slower than BM16 at
    # M 4-256, where BM16 is the pick); its own range (16-48 rows per expert, M 685-2053 at
    # KIMI-K2.5) is not measured.
    32: MoeMxfp4Config(BLOCK_M=32, BLOCK_N=64, NT=True, PREPACK=2),
    # BM64 / BM128: not measured yet; chosen so that they are correct (interpreter tests: the
    # plain layout's bits), valid for every prepacked shape (BN64) and compile without spills for
    # sm_90 (cross-compiled, KIMI shapes: BM64 126 registers, 4 programs per SM, HGMMA.64x64x16;
    # BM128 220 registers, 2 per SM, HGMMA.64x128x16). NT off: an expert's row blocks reread its
    # weights from L2, as in _BY_BLOCK_M. M = 16384 at KIMI-K2.5 runs BM128. SASS instructions per
    # weight and 128 rows (experiments/probes/sass_moe_mxfp4_variants.py): 7.6 here against 6.3 for the
    # plain BM128 default (the activations' even/odd split and shared-memory tile are paid per 64
    # columns) and 6.0 for BM128 BN128 PREPACK=2 (255 registers, 12 spill stores; 35 in the
    # deterministic mode; needs H % 128 == 0): if M = 16384 stays issue-bound, BN128 is the
    # faster. run_moe_mxfp4_variants.py --m 16384 times both ("prepacked default", "BM128 BN128
    # prepack2").
    # Measured at M = 16384 (commit 11452a2, results/moe_mxfp4/variants_prepack/, graph replay):
    # BM128 BN128 PREPACK=2 4,051 us against 5,659 for BN64 and 5,265 for the plain default, 1.18x
    # the bf16-weight grouped GEMM (4,776 us); so BM128 takes BN128 (BN64 where H % 128 != 0). This
    # pick is made at the M it is reported at (as the plain BM128 default was); BM64's own range
    # (M 2054-6844 at KIMI-K2.5) is not measured (at M = 16384 its BN128 ran 4,363 us, BN64 5,210).
    # With ONE_MUL (b65ab38, bf70d1e; results/moe_mxfp4/onemul_shl/) the same picks run 1.08-1.13x
    # faster at M 4-256 (31.0-257.8 us, 0.53-0.72 of the HBM bound) and 1.06x at 16384 (3,814 us).
    64: MoeMxfp4Config(BLOCK_M=64, BLOCK_N=64, SWAP_AB=True, NT=False, PREPACK=2),
    128: MoeMxfp4Config(BLOCK_M=128, BLOCK_N=128, SWAP_AB=True, NT=False, PREPACK=2),
}
