"""Weight-only-quantized GEMM: activations times INT4 or FP8 weights, dequantized in registers.

Both formats store a weight W [N, K] (out x in) as codes and one scale per block of SCALE_BLOCK_N rows by
SCALE_BLOCK_K columns; partial last blocks are allowed:
  int4 (compressed-tensors `pack-quantized`, group size G along K; scale blocks 1 x G):
    weight_packed int32 [N, ceil(K/8)]: value k in bits 4*(k % 8) of word k // 8, stored as q + 8 (q in -8..7),
    weight_scale [N, ceil(K/G)] (fp32, bf16 or fp16):       W[n, k] = q[n, k] * weight_scale[n, k // G]
  fp8 (the DeepSeek-V3 / GLM-5 FP8 releases; scale blocks bn x bk, normally 128 x 128):
    weight float8_e4m3fn [N, K],
    weight_scale_inv fp32 [ceil(N/bn), ceil(K/bk)]:         W[n, k] = weight[n, k] * weight_scale_inv[n//bn, k//bk]

y = x @ W.T: a program owns a BLOCK_M x BLOCK_N tile of y and walks K in BLOCK_K steps (`weight_matmul_k_range`).
Each step loads a tile of activations, decodes the [BLOCK_N, BLOCK_K] weight tile to fp32 and accumulates with
tl.dot in fp32. Only the decode depends on the format, chosen by the constexpr WEIGHT_FORMAT:
  int4 (`int4_weight_tile`): load [BLOCK_N, BLOCK_K/8] words, shift out their eight nibbles and scale each word by
    its group's scale (G is a multiple of 8, so a word never straddles two groups; a tile may hold part of a group
    or several groups). Elements past K are masked on the activation side, so the padding nibbles never matter.
  fp8 (`fp8_weight_tile`): load [BLOCK_N, BLOCK_K] e4m3 codes and multiply row n by the scale of its row block
    n // bn. BLOCK_K divides bk and every tile starts at a multiple of BLOCK_K, so a tile lies in one scale
    column, k0 // bk: one scale per row.

FP8 runs as W8A16 (weights dequantized in registers, then a 16-bit or fp32 tl.dot), not W8A8 (quantizing the
activations per token in groups of 128 and running an 8-bit tl.dot, as DeepSeek's own kernels do), because
  - both formats share one K loop, and only the weight-tile decode differs;
  - there is no activation-quantization pass and none of its rounding error: the kernel computes what the CPU
    path computes (dequantized weights times the activations as they are), up to summation order;
  - decode, the phase these kernels are for, is bandwidth-bound: the bytes of weight read decide its time, and
    they are the same one byte per weight (plus a scale per block) either way.
The known cost: compute-bound prefill on Hopper forgoes the FP8 tensor cores' 2x FLOP/s over 16-bit ones.
benchmarks/gpu.py measures this kernel's share of peak beside torch._scaled_mm, so the gap is measured once a
GPU run exists.

FP8 weights are passed as float8_e4m3fn tensors (Triton's fp8e4nv). Under the interpreter a load and a cast to
fp32 are exact for all 254 finite codes (checked against torch; the two NaN codes read as +-480 there, and
checkpoints hold none). On NVIDIA, Triton has fp8e4nv from compute capability 8.9 (Ada, Hopper)
on; a uint8 view bitcast to fp8e4nv in the kernel would meet the same rule, so it would gain nothing.
`check_fp8_device` turns an older GPU into one clear error instead of a compile failure.

Decode (small M) has too few output tiles to fill the GPU, so K can also be split across SPLIT_K programs per
tile: each writes an fp32 partial [SPLIT_K, M, N] and the partials are summed afterwards (deterministic).

`weight_matmul_k_range` (the K loop) and the checks are shared with the fused MoE kernel in nano.kernels.moe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nano.kernels.common import check_dot_sizes, check_same_device, dot_config, sm_count

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT4_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_SCALE_DTYPES = (torch.float32,)
WEIGHT_FORMATS = ("int4", "fp8")
VALUES_PER_WORD = 8


@triton.jit
def int4_weight_tile(w_rows, s_rows, col_ok, k0, K,
                     SCALE_BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[cols, k0:k0 + BLOCK_K] in fp32 [BN, BK] from INT4 words; w_rows / s_rows [BN] point at the word row and
    the scale row of each column (col_ok masks them); SCALE_BLOCK_K is the group size."""
    words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)                                    # [BK/8]
    word_ok = col_ok[:, None] & (words_k < tl.cdiv(K, 8))[None, :]                    # [BN, BK/8]
    words = tl.load(w_rows[:, None] + words_k[None, :], mask=word_ok, other=0)
    scale = tl.load(s_rows[:, None] + (words_k * 8 // SCALE_BLOCK_K)[None, :], mask=word_ok, other=0.0)
    shifts = tl.arange(0, 8) * 4                                                      # [8]
    q = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) - 8                     # [BN, BK/8, 8]
    w = q.to(tl.float32) * scale.to(tl.float32)[:, :, None]
    return tl.reshape(w, [BLOCK_N, BLOCK_K])                                          # k = 8 * word + nibble


@triton.jit
def fp8_weight_tile(w_rows, s_rows, col_ok, k0, K, SCALE_BLOCK_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[cols, k0:k0 + BLOCK_K] in fp32 [BN, BK] from e4m3 codes; w_rows [BN] points at each column's code row,
    s_rows [BN] at the scale row of its row block (col_ok masks them). BLOCK_K divides SCALE_BLOCK_K = bk and k0
    is a multiple of BLOCK_K, so the tile lies in scale column k0 // bk."""
    ks = k0 + tl.arange(0, BLOCK_K)                                                   # [BK]
    codes = tl.load(w_rows[:, None] + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    scale = tl.load(s_rows + k0 // SCALE_BLOCK_K, mask=col_ok, other=0.0)             # [BN]
    return codes.to(tl.float32) * scale[:, None]                                      # [BN, BK]


@triton.jit
def weight_matmul_k_range(acc, a_rows, row_ok, w_rows, s_rows, col_ok, k_start, k_end, K,
                          WEIGHT_FORMAT: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BM, BN] + A[:, k_start:k_end] @ W[:, k_start:k_end].T in fp32, W in WEIGHT_FORMAT ("int4" or "fp8").

    a_rows [BM]: pointers to the activation rows (row_ok masks them); w_rows / s_rows [BN]: pointers to the weight
    row and the scale row of each output column (col_ok masks them). k_start is a multiple of BLOCK_K."""
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)                                               # [BK]
        a = tl.load(a_rows[:, None] + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        if WEIGHT_FORMAT == "int4":
            w = int4_weight_tile(w_rows, s_rows, col_ok, k0, K, SCALE_BLOCK_K, BLOCK_N, BLOCK_K)
        else:
            w = fp8_weight_tile(w_rows, s_rows, col_ok, k0, K, SCALE_BLOCK_K, BLOCK_K)
        acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemm_kernel(
    x, w, scale, out, M, N, K, k_per_split, stride_xm, stride_wn, stride_sn,
    WEIGHT_FORMAT: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (output tile, split): out[split, tile] = x[tile rows, chunk] @ W[tile cols, chunk].T, where
    chunk = [split * k_per_split, (split + 1) * k_per_split) clipped to K. With one split, out is y itself."""
    tile, split = tl.program_id(0), tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)                        # [BM]
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)                         # [BN]
    row_ok, col_ok = rows < M, cols < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = weight_matmul_k_range(acc, x + rows.to(tl.int64) * stride_xm, row_ok, w + cols.to(tl.int64) * stride_wn,
                                scale + (cols // SCALE_BLOCK_N).to(tl.int64) * stride_sn, col_ok, k_start, k_end, K,
                                WEIGHT_FORMAT, SCALE_BLOCK_K, BLOCK_N, BLOCK_K, DOT_DTYPE, PRECISION)
    out_rows = (split * M + rows).to(tl.int64) * N                                    # out is [SPLIT_K, M, N]
    tl.store(out + out_rows[:, None] + cols[None, :], acc.to(out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def check_fp8_device(device: torch.device) -> None:
    """Triton has float8_e4m3fn (fp8e4nv) on NVIDIA from compute capability 8.9 on."""
    if device.type == "cuda" and (capability := torch.cuda.get_device_capability(device)) < (8, 9):
        raise ValueError(f"FP8 weights need a GPU of compute capability >= 8.9 (Ada, Hopper) for Triton's "
                         f"float8_e4m3fn, got {capability[0]}.{capability[1]}")


def check_activation(name: str, a: torch.Tensor) -> None:
    if a.dim() != 2 or a.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name} must be a 2-D tensor of one of {ACTIVATION_DTYPES}, got {a.dtype} {tuple(a.shape)}")
    if a.stride(-1) != 1:
        raise ValueError(f"the last dimension of {name} must be contiguous (stride 1)")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_codes_and_scales(names: tuple[str, str], codes: torch.Tensor, scale: torch.Tensor,
                            code_dtype: torch.dtype, code_shape: tuple[int, ...],
                            scale_dtypes: tuple[torch.dtype, ...], scale_shape: tuple[int, ...], layout: str) -> None:
    """The checks both formats share: the codes' dtype and shape, the scales' dtype and shape, contiguous rows.
    names = (codes, scales) as the caller's arguments call them; layout ends each message."""
    code_name, scale_name = names
    if codes.dtype != code_dtype or tuple(codes.shape) != code_shape:
        raise ValueError(f"{code_name} must be {_dtype_name(code_dtype)} {list(code_shape)} {layout}, got "
                         f"{_dtype_name(codes.dtype)} {list(codes.shape)}")
    if scale.dtype not in scale_dtypes or tuple(scale.shape) != scale_shape:
        raise ValueError(f"{scale_name} must be {list(scale_shape)} in {'/'.join(map(_dtype_name, scale_dtypes))} "
                         f"{layout}, got {_dtype_name(scale.dtype)} {list(scale.shape)}")
    if codes.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError(f"the last dimension of {code_name} and {scale_name} must be contiguous (stride 1)")


def check_int4_weight(names: tuple[str, str], packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...],
                      group_size: int) -> tuple[int, int]:
    """packed / scale must hold the INT4 weight of logical shape (..., N, K): int32 (..., N, ceil(K/8)) words and
    (..., N, ceil(K/G)) scales. Returns the scale block (1, G)."""
    if group_size < VALUES_PER_WORD or group_size % VALUES_PER_WORD:
        raise ValueError(f"group_size must be a positive multiple of 8 (one int32 word per group), got {group_size}")
    *lead, k = shape
    _check_codes_and_scales(names, packed, scale, torch.int32, (*lead, triton.cdiv(k, VALUES_PER_WORD)),
                            INT4_SCALE_DTYPES, (*lead, triton.cdiv(k, group_size)),
                            f"for an INT4 weight of shape {list(shape)} with group size {group_size} (eight values "
                            f"per int32 word along K)")
    return 1, group_size


def check_fp8_weight(names: tuple[str, str], weight: torch.Tensor, scale_inv: torch.Tensor, shape: tuple[int, ...],
                     block: tuple[int, int], block_k: int) -> tuple[int, int]:
    """weight / scale_inv must hold the FP8 weight of logical shape (..., N, K): float8_e4m3fn (..., N, K) codes
    and fp32 (..., ceil(N/bn), ceil(K/bk)) scales, block = (bn, bk). Returns the scale block (bn, bk).
    A K tile must lie within one scale block, so block_k divides bk."""
    if len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
        raise ValueError(f"the FP8 scale block must be two positive ints (bn, bk), got {block}")
    if block[1] % block_k:
        raise ValueError(f"block_k={block_k} must divide the FP8 scale block's K size bk={block[1]}, so that a K "
                         f"tile lies within one scale block")
    *lead, n, k = shape
    bn, bk = block
    _check_codes_and_scales(names, weight, scale_inv, torch.float8_e4m3fn, tuple(shape), FP8_SCALE_DTYPES,
                            (*lead, triton.cdiv(n, bn), triton.cdiv(k, bk)),
                            f"for an FP8 weight of shape {list(shape)} in scale blocks of {bn} x {bk}")
    check_fp8_device(weight.device)
    return bn, bk


def default_block_m(rows: int) -> int:
    """The smallest of 16, 32, 64 that covers `rows` (64 beyond)."""
    return min(64, max(16, triton.next_power_of_2(rows)))


def _default_split_k(device: torch.device, programs: int, k_tiles: int) -> int:
    """On CUDA, enough splits for about two programs per SM (at most one per K tile); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return max(1, min(k_tiles, triton.cdiv(2 * sm_count(device), programs)))


def _gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, n: int, weight_format: str,
          scale_block: tuple[int, int], split_k: int | None, block_m: int | None, block_n: int,
          block_k: int) -> torch.Tensor:
    """What w4a16_gemm and fp8_gemm share once their weight is checked: y = x @ W.T [M, N] in x.dtype, with the
    split-K plan, the launch and the sum of the partials."""
    check_same_device(x, weight, scale)
    m, k = x.shape
    block_m = default_block_m(m) if block_m is None else block_m
    check_dot_sizes(block_m=block_m, block_n=block_n, block_k=block_k)
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=x.dtype, device=x.device)

    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    splits = _default_split_k(x.device, programs, k_tiles) if split_k is None else min(split_k, k_tiles)
    tiles_per_split = triton.cdiv(k_tiles, splits)
    splits = triton.cdiv(k_tiles, tiles_per_split)                   # no split left empty
    dot_dtype, precision = dot_config(x.dtype)

    out = (torch.empty(m, n, dtype=x.dtype, device=x.device) if splits == 1
           else torch.empty(splits, m, n, dtype=torch.float32, device=x.device))
    _gemm_kernel[(programs, splits)](
        x, weight, scale, out, m, n, k, tiles_per_split * block_k, x.stride(0), weight.stride(0), scale.stride(0),
        WEIGHT_FORMAT=weight_format, SCALE_BLOCK_N=scale_block[0], SCALE_BLOCK_K=scale_block[1], BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT_DTYPE=dot_dtype, PRECISION=precision, num_warps=4, num_stages=3,
    )
    return out if splits == 1 else out.sum(0).to(x.dtype)


def w4a16_gemm(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int, *,
               split_k: int | None = None, block_m: int | None = None, block_n: int = 64,
               block_k: int = 64) -> torch.Tensor:
    """y = x @ W.T -> [M, N] in x.dtype (contiguous), W given in the compressed-tensors INT4 layout.

    x [M, K] (fp32, bf16 or fp16; K is the weight's true input size, padding excluded),
    weight_packed int32 [N, ceil(K/8)], weight_scale [N, ceil(K/G)] (fp32, bf16 or fp16),
    group_size G: a multiple of 8.
    split_k splits K across programs (fp32 partials, then a sum); None picks it from the SM count on CUDA and
    1 elsewhere; at most cdiv(K, block_k) splits are used. block_m (None: 16, 32 or 64 from M), block_n and
    block_k: powers of two >= 16.
    """
    check_activation("x", x)
    if weight_packed.dim() != 2:
        raise ValueError(f"weight_packed must be int32 [N, ceil(K/8)], got {tuple(weight_packed.shape)}")
    n = weight_packed.shape[0]
    scale_block = check_int4_weight(("weight_packed", "weight_scale"), weight_packed, weight_scale,
                                    (n, x.shape[1]), group_size)
    return _gemm(x, weight_packed, weight_scale, n, "int4", scale_block, split_k, block_m, block_n, block_k)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
             block_size: tuple[int, int] = (128, 128), *, split_k: int | None = None, block_m: int | None = None,
             block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """y = x @ W.T -> [M, N] in x.dtype (contiguous), W given as FP8 codes with block scales.

    x [M, K] (fp32, bf16 or fp16), weight float8_e4m3fn [N, K],
    weight_scale_inv fp32 [ceil(N/bn), ceil(K/bk)] for block_size (bn, bk): W[n, k] = weight[n, k] *
    weight_scale_inv[n // bn, k // bk]. block_k must divide bk. split_k, block_m, block_n, block_k: as in
    w4a16_gemm.
    """
    check_activation("x", x)
    if weight.dim() != 2:
        raise ValueError(f"weight must be float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n = weight.shape[0]
    scale_block = check_fp8_weight(("weight", "weight_scale_inv"), weight, weight_scale_inv, (n, x.shape[1]),
                                   block_size, block_k)
    return _gemm(x, weight, weight_scale_inv, n, "fp8", scale_block, split_k, block_m, block_n, block_k)
