"""Fused MoE over experts with INT4 or FP8 weights (the formats of nano.kernels.gemm), dequantized in registers.

For token t and each of its top_k routes (slot j, expert e = topk_ids[t, j], weight r = topk_weights[t, j]):
    [gate | up] = x_t @ W13[e].T        W13[e] = cat(gate_proj.weight, up_proj.weight) along N: [2I, H]
    h           = silu(gate) * up       [I]
    y[t]       += r * (h @ W2[e].T)     W2[e] = down_proj.weight: [H, I]

The T * top_k routes are numbered id = t * top_k + j. `moe_align_block_size` sorts them by expert and pads
each expert's list to whole blocks of BLOCK_M with a sentinel id, so every block belongs to one expert. One
grouped-GEMM kernel then runs twice: a program takes one (block, N tile), gathers its block's activation rows
(x[id // top_k] for the first GEMM, the intermediate's row id for the second), skips sentinel rows and
multiplies by its expert's weight tile, decoded in registers by the K loop the dense GEMM uses
(`weight_matmul_k_range`, WEIGHT_FORMAT "int4" or "fp8"). The activation and the final sum over the top_k
routes run in torch between and after them.

For FP8 the concatenation [gate | up] must keep the scale blocks of gate and up whole, so I must be a multiple
of the block's row size bn; then W13's scales are the concatenation of gate's and up's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nano.kernels.common import check_dot_sizes, check_same_device, dot_config
from nano.kernels.gemm import (WEIGHT_FORMATS, check_activation, check_fp8_weight, check_int4_weight, default_block_m,
                               weight_matmul_k_range)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Group the routes by expert in blocks of block_m rows.

    topk_ids [T, top_k] (integer, values in [0, num_experts)) -> (sorted_token_ids int32 [P], expert_ids int32
    [P // block_m], P): the route ids t * top_k + j ordered by expert (by id within an expert), each expert's
    run padded to a multiple of block_m with the sentinel T * top_k; expert_ids[b] is block b's expert. Experts
    without routes get no block, so P = sum_e ceil(count_e / block_m) * block_m. Reading P syncs with the device.
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64 [T, top_k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    experts = topk_ids.reshape(-1).long()                                              # [T * top_k] by route id
    counts = torch.bincount(experts, minlength=num_experts)                            # [E]
    if counts.numel() != num_experts:
        raise ValueError(f"topk_ids holds expert {counts.numel() - 1}, but there are only {num_experts} experts")
    padded = (counts + block_m - 1) // block_m * block_m                               # [E] rows per expert
    total = int(padded.sum())

    order = torch.argsort(experts, stable=True)                                        # route ids by expert
    sorted_experts = experts[order]
    first_padded = torch.cumsum(padded, 0) - padded                                    # [E] where runs start
    first_sorted = torch.cumsum(counts, 0) - counts                                    # [E] same, unpadded
    rank = torch.arange(order.numel(), device=order.device) - first_sorted[sorted_experts]  # place within run
    sorted_token_ids = torch.full((total,), experts.numel(), dtype=torch.int32, device=topk_ids.device)
    sorted_token_ids[first_padded[sorted_experts] + rank] = order.int()
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, dtype=torch.int32, device=topk_ids.device),
                                         padded // block_m)
    return sorted_token_ids, expert_ids, total


@triton.jit
def _moe_gemm_kernel(
    a, w, scale, out, sorted_token_ids, expert_ids, topk_weights, num_routes, routes_per_a_row, N, K,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    MUL_ROUTED_WEIGHT: tl.constexpr, WEIGHT_FORMAT: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (block, N tile): out[id] = a[id // routes_per_a_row] @ W[e].T (times the route's weight if
    MUL_ROUTED_WEIGHT) for the route ids of one block, all routed to expert e; sentinel ids are skipped."""
    block, tile_n = tl.program_id(0), tl.program_id(1)
    ids = tl.load(sorted_token_ids + block * BLOCK_M + tl.arange(0, BLOCK_M))          # [BM]
    row_ok = ids < num_routes                                                         # sentinel = num_routes
    expert = tl.load(expert_ids + block).to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)                                   # [BN]
    col_ok = cols < N

    a_rows = a + (ids // routes_per_a_row).to(tl.int64) * stride_am
    w_rows = w + expert * stride_we + cols.to(tl.int64) * stride_wn
    s_rows = scale + expert * stride_se + (cols // SCALE_BLOCK_N).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = weight_matmul_k_range(acc, a_rows, row_ok, w_rows, s_rows, col_ok, 0, K, K,
                                WEIGHT_FORMAT, SCALE_BLOCK_K, BLOCK_N, BLOCK_K, DOT_DTYPE, PRECISION)
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_weights + ids, mask=row_ok, other=0.0)[:, None]
    out_rows = ids.to(tl.int64) * stride_om
    tl.store(out + out_rows[:, None] + cols[None, :], acc.to(out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _grouped_gemm(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                  sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor, routes_per_a_row: int,
                  topk_weights: torch.Tensor | None, weight_format: str, scale_block: tuple[int, int], block_m: int,
                  block_n: int, block_k: int) -> None:
    """out [T * top_k, N] rows of the routes = gathered rows of a @ W[expert].T, W [E, N, K] in weight_format with
    scales [E, ceil(N/SCALE_BLOCK_N), ceil(K/SCALE_BLOCK_K)]."""
    n, k = out.shape[1], a.shape[1]
    dot_dtype, precision = dot_config(a.dtype)
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, weight, scale, out, sorted_token_ids, expert_ids, out if topk_weights is None else topk_weights,
        out.shape[0], routes_per_a_row, n, k, a.stride(0), weight.stride(0), weight.stride(1), scale.stride(0),
        scale.stride(1), out.stride(0),
        MUL_ROUTED_WEIGHT=topk_weights is not None, WEIGHT_FORMAT=weight_format, SCALE_BLOCK_N=scale_block[0],
        SCALE_BLOCK_K=scale_block[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_DTYPE=dot_dtype,
        PRECISION=precision, num_warps=4, num_stages=3,
    )


def _check_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                   w2_scale: torch.Tensor, weight_format: str, group_size: int | None, fp8_block: tuple[int, int],
                   block_k: int) -> tuple[tuple[int, int], int]:
    """Check the stacked expert weights against x [T, H]; returns (the scale block, I)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format == "int4" and group_size is None:
        raise ValueError("weight_format='int4' needs group_size")
    if weight_format == "fp8" and group_size is not None:
        raise ValueError(f"group_size={group_size} is for weight_format='int4' only (FP8 blocks are fp8_block)")
    w13_k, w2_k = ("ceil(H/8)", "ceil(I/8)") if weight_format == "int4" else ("H", "I")
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"expected w13 [E, 2I, {w13_k}] and w2 [E, H, {w2_k}], got {tuple(w13.shape)} and "
                         f"{tuple(w2.shape)}")
    hidden = x.shape[1]
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if weight_format == "int4":
        check_int4_weight(("w13", "w13_scale"), w13, w13_scale, (experts, 2 * inter, hidden), group_size)
        return check_int4_weight(("w2", "w2_scale"), w2, w2_scale, (experts, hidden, inter), group_size), inter
    check_fp8_weight(("w13", "w13_scale"), w13, w13_scale, (experts, 2 * inter, hidden), fp8_block, block_k)
    if inter % fp8_block[0]:
        raise ValueError(f"the expert width I={inter} must be a multiple of the FP8 block's row size "
                         f"bn={fp8_block[0]}, so that [gate | up] keeps whole scale blocks")
    return check_fp8_weight(("w2", "w2_scale"), w2, w2_scale, (experts, hidden, inter), fp8_block, block_k), inter


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, weight_format: str,
              group_size: int | None = None, fp8_block: tuple[int, int] = (128, 128), block_m: int | None = None,
              block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """Routed-expert MLP of a MoE layer -> [T, H] in x.dtype: sum over routes of weight * expert(x_t).

    x [T, H] (fp32, bf16 or fp16); per expert e, gate rows then up rows in w13, in weight_format:
      "int4" (compressed-tensors, group size G = group_size, required): w13 int32 [E, 2I, ceil(H/8)],
        w13_scale [E, 2I, ceil(H/G)], w2 int32 [E, H, ceil(I/8)], w2_scale [E, H, ceil(I/G)] (fp32, bf16 or fp16);
      "fp8" (block scales, fp8_block = (bn, bk)): w13 float8_e4m3fn [E, 2I, H], w13_scale fp32
        [E, ceil(2I/bn), ceil(H/bk)], w2 float8_e4m3fn [E, H, I], w2_scale fp32 [E, ceil(H/bn), ceil(I/bk)];
        I must be a multiple of bn and block_k must divide bk;
    topk_ids [T, top_k] int32/int64 in [0, E), topk_weights fp32 [T, top_k] (applied as given: normalise and
    scale them before). block_m (None: from the average routes per expert), block_n, block_k: powers of two >= 16.
    The intermediates are [T * top_k, 2I] and [T * top_k, H] in x.dtype: chunk long prefills.
    """
    check_activation("x", x)
    scale_block, inter = _check_experts(x, w13, w13_scale, w2, w2_scale, weight_format, group_size, fp8_block, block_k)
    tokens, hidden = x.shape
    experts = w13.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64 [T={tokens}, top_k], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32 {list(topk_ids.shape)} like topk_ids, got {topk_weights.dtype} "
                         f"{list(topk_weights.shape)}")
    check_same_device(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights)
    top_k = topk_ids.shape[1]
    block_m = default_block_m(triton.cdiv(tokens * top_k, experts)) if block_m is None else block_m
    check_dot_sizes(block_m=block_m, block_n=block_n, block_k=block_k)
    if tokens * top_k == 0:
        return torch.zeros_like(x)

    sorted_token_ids, expert_ids, _ = moe_align_block_size(topk_ids, experts, block_m)
    blocks = dict(weight_format=weight_format, scale_block=scale_block, block_m=block_m, block_n=block_n,
                  block_k=block_k)
    gate_up = torch.empty(tokens * top_k, 2 * inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, w13_scale, gate_up, sorted_token_ids, expert_ids, top_k, None, **blocks)
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]                               # [T * top_k, I]
    routed = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(h, w2, w2_scale, routed, sorted_token_ids, expert_ids, 1, topk_weights.reshape(-1), **blocks)
    return routed.view(tokens, top_k, hidden).sum(1)
