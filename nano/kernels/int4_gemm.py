"""W4A16 GEMM: activations times compressed-tensors `pack-quantized` INT4 weights, dequantized in registers.

A weight W [N, K] (out x in) with group size G along K is stored as
    weight_packed int32 [N, ceil(K/8)]: value k in bits 4*(k % 8) of word k // 8, stored as q + 8 (q in -8..7),
    weight_scale  [N, ceil(K/G)] (fp32, bf16 or fp16):  W[n, k] = q[n, k] * weight_scale[n, k // G].

y = x @ W.T: a program owns a BLOCK_M x BLOCK_N tile of y and walks K in BLOCK_K steps. Each step loads a
[BLOCK_N, BLOCK_K/8] tile of words, shifts out their eight nibbles, scales each word by its group's scale (G is
a multiple of 8, so a word never straddles two groups, and a tile may hold part of a group or several groups)
and accumulates with tl.dot in fp32. Elements past K are masked on the activation side, so the padding nibbles
of the last word never matter.

Decode (small M) has too few output tiles to fill the GPU, so K can also be split across SPLIT_K programs per
tile: each writes an fp32 partial [SPLIT_K, M, N] and the partials are summed afterwards (deterministic).

`int4_matmul_k_range` (the K loop) and the checks are shared with the fused MoE kernel in nano.kernels.int4_moe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nano.kernels.common import dot_config, is_pow2_at_least_16, sm_count

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VALUES_PER_WORD = 8


@triton.jit
def int4_matmul_k_range(acc, a_rows, row_ok, w_rows, s_rows, col_ok, k_start, k_end, K,
                        GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BM, BN] + A[:, k_start:k_end] @ W[:, k_start:k_end].T in fp32.

    a_rows [BM]: pointers to the activation rows (row_ok masks them); w_rows / s_rows [BN]: pointers to the
    packed-word rows and the scale rows of W (col_ok masks them). k_start is a multiple of BLOCK_K."""
    num_words = tl.cdiv(K, 8)
    shifts = tl.arange(0, 8) * 4                                                          # [8]
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)                                                   # [BK]
        a = tl.load(a_rows[:, None] + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)                                    # [BK/8]
        word_ok = col_ok[:, None] & (words_k < num_words)[None, :]                        # [BN, BK/8]
        words = tl.load(w_rows[:, None] + words_k[None, :], mask=word_ok, other=0)
        scale = tl.load(s_rows[:, None] + (words_k * 8 // GROUP_SIZE)[None, :], mask=word_ok, other=0.0)
        q = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) - 8                     # [BN, BK/8, 8]
        w = q.to(tl.float32) * scale.to(tl.float32)[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])                                             # k = 8 * word + nibble
        acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _w4a16_gemm_kernel(
    x, w, scale, out, M, N, K, k_per_split, stride_xm, stride_wn, stride_sn,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (output tile, split): out[split, tile] = x[tile rows, chunk] @ W[tile cols, chunk].T, where
    chunk = [split * k_per_split, (split + 1) * k_per_split) clipped to K. With one split, out is y itself."""
    tile, split = tl.program_id(0), tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)                            # [BM]
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)                             # [BN]
    row_ok, col_ok = rows < M, cols < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = int4_matmul_k_range(acc, x + rows.to(tl.int64) * stride_xm, row_ok, w + cols.to(tl.int64) * stride_wn,
                              scale + cols.to(tl.int64) * stride_sn, col_ok, k_start, k_end, K,
                              GROUP_SIZE, BLOCK_N, BLOCK_K, DOT_DTYPE, PRECISION)
    out_rows = (split * M + rows).to(tl.int64) * N                                        # out is [SPLIT_K, M, N]
    tl.store(out + out_rows[:, None] + cols[None, :], acc.to(out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def check_blocks(block_m: int, block_n: int, block_k: int) -> None:
    """Every tl.dot dimension must be a power of two >= 16 (the smallest tl.dot on NVIDIA; the interpreter
    would accept less, so it is checked here)."""
    if not all(is_pow2_at_least_16(b) for b in (block_m, block_n, block_k)):
        raise ValueError(f"block_m={block_m}, block_n={block_n} and block_k={block_k} must be powers of two >= 16")


def check_group_size(group_size: int) -> None:
    if group_size < VALUES_PER_WORD or group_size % VALUES_PER_WORD:
        raise ValueError(f"group_size must be a positive multiple of 8 (one int32 word per group), got {group_size}")


def check_activation(name: str, a: torch.Tensor) -> None:
    if a.dim() != 2 or a.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name} must be a 2-D tensor of one of {ACTIVATION_DTYPES}, got {a.dtype} "
                         f"{tuple(a.shape)}")
    if a.stride(-1) != 1:
        raise ValueError(f"the last dimension of {name} must be contiguous (stride 1)")


def check_int4_weight(name: str, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...],
                      group_size: int) -> None:
    """packed / scale must hold the INT4 weight of logical shape (..., N, K): int32 (..., N, ceil(K/8)) words and
    (..., N, ceil(K/G)) scales, each with a contiguous last dimension."""
    *lead, k = shape
    words = (*lead, triton.cdiv(k, VALUES_PER_WORD))
    groups = (*lead, triton.cdiv(k, group_size))
    if packed.dtype != torch.int32 or tuple(packed.shape) != words:
        raise ValueError(f"{name}_packed must be int32 {list(words)} for a weight of shape {list(shape)} "
                         f"(eight values per word along K), got {packed.dtype} {list(packed.shape)}")
    if scale.dtype not in SCALE_DTYPES or tuple(scale.shape) != groups:
        raise ValueError(f"{name}_scale must be {list(groups)} for a weight of shape {list(shape)} with group size "
                         f"{group_size}, in one of {SCALE_DTYPES}; got {scale.dtype} {list(scale.shape)}")
    if packed.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError(f"the last dimension of {name}_packed and {name}_scale must be contiguous (stride 1)")


def check_same_device(*tensors: torch.Tensor) -> None:
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted({str(t.device) for t in tensors})}")


def default_block_m(rows: int) -> int:
    """The smallest of 16, 32, 64 that covers `rows` (64 beyond)."""
    return min(64, max(16, triton.next_power_of_2(rows)))


def _default_split_k(device: torch.device, programs: int, k_tiles: int) -> int:
    """On CUDA, enough splits for about two programs per SM (at most one per K tile); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    return max(1, min(k_tiles, triton.cdiv(2 * sms, programs)))


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
    check_group_size(group_size)
    if weight_packed.dim() != 2:
        raise ValueError(f"weight_packed must be int32 [N, ceil(K/8)], got {tuple(weight_packed.shape)}")
    m, k = x.shape
    n = weight_packed.shape[0]
    check_int4_weight("weight", weight_packed, weight_scale, (n, k), group_size)
    check_same_device(x, weight_packed, weight_scale)
    block_m = default_block_m(m) if block_m is None else block_m
    check_blocks(block_m, block_n, block_k)
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
    _w4a16_gemm_kernel[(programs, splits)](
        x, weight_packed, weight_scale, out, m, n, k, tiles_per_split * block_k,
        x.stride(0), weight_packed.stride(0), weight_scale.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_DTYPE=dot_dtype,
        PRECISION=precision, num_warps=4, num_stages=3,
    )
    return out if splits == 1 else out.sum(0).to(x.dtype)
