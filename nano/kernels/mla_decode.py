"""Paged MLA decode attention in the absorbed form, as a Triton kernel.

One decode step: each of B sequences has one query token, and its cache lives in fixed-size pages of a shared
pool, one row per token: [latent c (C values) | rope key k_pe (R values)]. Every head reads the same row
(MLA is MQA-like in the absorbed form), so one program serves a block of heads of one sequence and loads each
KV tile once for all of them:

    score[h, s] = (q_abs[h] . c_s + q_pe[h] . k_pe_s) * scale_s * softmax_scale
    out[h]      = sum_s softmax(score[h])[s] * scale_s * c_s

The pages are read in place in each of the pool's formats (nano/kv.py), dequantized only in registers:
    plain, FP8 tensor   the row as stored, scale_s = 1;
    FP8 token           e4m3 row and a per-token scale_s, folded into the scores and the probabilities;
    FP8 tile            e4m3 latent [C] with a power-of-two scale per C / tiles values (multiplied in as the
                        latent is loaded, scale_s = 1) and the rope key in its own BF16 pages [R].
The softmax is online (running max and sum, fp32).

Long contexts with few sequences would leave most of the GPU idle, so the sequence can also be split into
`num_splits` chunks (flash-decoding): each chunk writes its normalised partial output and log-sum-exp, and a
second small kernel merges them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nano.kernels.common import check_dot_sizes, check_same_device, dot_config, sm_count

_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PAGE_DTYPES = _QUERY_DTYPES + (torch.float8_e4m3fn,)
_LOG2E = 1.4426950408889634


@triton.jit
def _load_heads(x, row, heads, head_ok, stride_row, stride_head, D: tl.constexpr):
    """x[row, heads] -> [BH, D] of a [rows, H, D] tensor (masked heads read 0)."""
    offsets = row * stride_row + heads[:, None] * stride_head + tl.arange(0, D)[None, :]
    return tl.load(x + offsets, mask=head_ok[:, None], other=0.0)


@triton.jit
def _store_heads(x, row, heads, head_ok, values, H, D: tl.constexpr):
    """x[row, heads] = values [BH, D], in x's dtype, for a contiguous [rows, H, D] tensor."""
    offsets = (row * H + heads[:, None]) * D + tl.arange(0, D)[None, :]
    tl.store(x + offsets, values.to(x.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _chunk(seq_lens, b, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """[start, end) of sequence b's cache that this split attends to: whole BLOCK_N tiles; the last chunk ends at
    the sequence end (and may be empty)."""
    seq_len = tl.load(seq_lens + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, seq_len)


@triton.jit
def _load_tokens(kv, kv_scale, rope, kv_rows, scale_rows, rope_rows, valid, C: tl.constexpr, R: tl.constexpr,
                 BLOCK_N: tl.constexpr, SCALES: tl.constexpr, TILES: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The tokens at these row offsets [BN] -> (latent [BN, C], rope key [BN, R]) in DOT_DTYPE, masked ones 0. The
    tile layout's latent comes out times its scales; the other layouts' values as stored."""
    cols_c, cols_r = tl.arange(0, C), tl.arange(0, R)
    c = tl.load(kv + kv_rows[:, None] + cols_c[None, :], mask=valid[:, None], other=0.0)
    if SCALES == "tile":
        # a power-of-two scale per C / TILES latent values (exact in fp32 and in DOT_DTYPE); the rope key apart
        tile_scale = tl.load(kv_scale + scale_rows[:, None] + tl.arange(0, TILES)[None, :], mask=valid[:, None],
                             other=0.0)                                                # [BN, TILES] fp32
        c = tl.reshape(tl.reshape(c.to(tl.float32), [BLOCK_N, TILES, C // TILES]) * tile_scale[:, :, None],
                       [BLOCK_N, C])
        k_pe = tl.load(rope + rope_rows[:, None] + cols_r[None, :], mask=valid[:, None], other=0.0)
    else:
        k_pe = tl.load(kv + kv_rows[:, None] + C + cols_r[None, :], mask=valid[:, None], other=0.0)
    return c.to(DOT_DTYPE), k_pe.to(DOT_DTYPE)


@triton.jit
def _mla_decode_kernel(
    q_abs, q_pe, kv, kv_scale, rope, page_table, seq_lens, out, part_out, part_lse,
    qk_scale,                                     # softmax_scale * log2(e): the softmax runs in base 2
    H, stride_qb, stride_qh, stride_pb, stride_ph, stride_kv_page, stride_kv_tok,
    stride_sc_page, stride_sc_tok, stride_rope_page, stride_rope_tok, stride_pt,
    C: tl.constexpr, R: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SCALES: tl.constexpr, TILES: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (b, head block, split): attention of BLOCK_H heads of sequence b over one chunk of its cache."""
    b, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)                              # [BH]
    head_ok = heads < H
    q = _load_heads(q_abs, b, heads, head_ok, stride_qb, stride_qh, C).to(DOT_DTYPE)                # [BH, C]
    qr = _load_heads(q_pe, b, heads, head_ok, stride_pb, stride_ph, R).to(DOT_DTYPE)                # [BH, R]
    start, end = _chunk(seq_lens, b, split, BLOCK_N, NUM_SPLITS)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)                                  # running max (log2)
    den = tl.zeros([BLOCK_H], tl.float32)                                              # running sum of p
    acc = tl.zeros([BLOCK_H, C], tl.float32)                                           # running sum of p * c
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)                                          # [BN]
        valid = tokens < end
        page = tl.load(page_table + b * stride_pt + tokens // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        slot = tokens % PAGE_SIZE                                                      # int64 rows: pools pass 2^31
        scale_rows = page * stride_sc_page + slot * stride_sc_tok                      # unused without scales
        c, k_pe = _load_tokens(kv, kv_scale, rope, page * stride_kv_page + slot * stride_kv_tok, scale_rows,
                               page * stride_rope_page + slot * stride_rope_tok, valid,
                               C, R, BLOCK_N, SCALES, TILES, DOT_DTYPE)                # [BN, C], [BN, R]
        s = tl.dot(q, tl.trans(c), input_precision=PRECISION)                          # [BH, BN] fp32
        s += tl.dot(qr, tl.trans(k_pe), input_precision=PRECISION)
        if SCALES == "token":
            tok_scale = tl.load(kv_scale + scale_rows, mask=valid, other=0.0)          # [BN] fp32
            s *= (tok_scale * qk_scale)[None, :]
        else:
            s *= qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))            # finite: every tile holds at least one valid token
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])                                                # [BH, BN]
        den = den * alpha + tl.sum(p, axis=1)
        if SCALES == "token":
            p *= tok_scale[None, :]                         # sum_s p_s * (scale_s * c_s), c as stored
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision=PRECISION)
        m = m_new

    den_safe = tl.where(den > 0, den, 1.0)                  # an empty chunk leaves den = 0
    if NUM_SPLITS == 1:
        _store_heads(out, b, heads, head_ok, acc / den_safe[:, None], H, C)
    else:
        part = b * NUM_SPLITS + split                       # row of part_out [B * NUM_SPLITS, H, C], part_lse
        _store_heads(part_out, part, heads, head_ok, acc / den_safe[:, None], H, C)
        lse = tl.where(den > 0, m + tl.log2(den_safe), float("-inf"))
        tl.store(part_lse + part * H + heads, lse, mask=head_ok)


@triton.jit
def _merge_splits_kernel(part_out, part_lse, out, H,
                         C: tl.constexpr, BLOCK_H: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Program (b, head block): out = sum_k w_k * part_k / sum_k w_k with w_k = 2^lse_k (the split's mass)."""
    b, head_block = tl.program_id(0), tl.program_id(1)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, C], tl.float32)
    for split in range(NUM_SPLITS):                         # split 0 is never empty, so m is finite after it
        part = b * NUM_SPLITS + split
        lse = tl.load(part_lse + part * H + heads, mask=head_ok, other=0.0)
        o = _load_heads(part_out, part, heads, head_ok, H * C, C, C)
        m_new = tl.maximum(m, lse)
        alpha, w = tl.exp2(m - m_new), tl.exp2(lse - m_new)
        den = den * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    _store_heads(out, b, heads, head_ok, acc / den[:, None], H, C)


def _default_splits(device: torch.device, programs: int) -> int:
    """Enough chunks for about one program per SM (at most 16); 1 off CUDA."""
    if device.type != "cuda":
        return 1
    return max(1, min(16, sm_count(device) // programs))


def _validate(q_abs: torch.Tensor, q_pe: torch.Tensor, kv_pages: torch.Tensor, kv_scale: torch.Tensor | None,
              rope_pages: torch.Tensor | None, page_table: torch.Tensor, seq_lens: torch.Tensor
              ) -> tuple[int, int, int, int, str]:
    """Check the inputs of `mla_decode_paged`; returns (B, H, C, R, the pages' scales: "none", "token" or "tile")."""
    if q_abs.dim() != 3 or q_pe.dim() != 3 or kv_pages.dim() != 3:
        raise ValueError(f"expected q_abs [B, H, C], q_pe [B, H, R] and kv_pages [P, page_size, C + R], got "
                         f"{tuple(q_abs.shape)}, {tuple(q_pe.shape)} and {tuple(kv_pages.shape)}")
    batch, heads, c = q_abs.shape
    r = q_pe.shape[2]
    if q_pe.shape[:2] != (batch, heads):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} does not match q_abs {tuple(q_abs.shape)} in B and H")
    check_dot_sizes(C=c, R=r)
    row, row_name = (c + r, "C + R") if rope_pages is None else (c, "C (the rope key is in rope_pages)")
    if kv_pages.shape[2] != row:
        raise ValueError(f"kv_pages rows hold {kv_pages.shape[2]} values, expected {row_name} = {row}")
    if kv_pages.dtype not in _PAGE_DTYPES:
        raise ValueError(f"kv_pages dtype {kv_pages.dtype} is not one of {_PAGE_DTYPES}")
    if q_abs.dtype not in _QUERY_DTYPES or q_pe.dtype not in _QUERY_DTYPES:
        raise ValueError(f"q_abs and q_pe must be one of {_QUERY_DTYPES}, got {q_abs.dtype} and {q_pe.dtype}")
    pages = tuple(kv_pages.shape[:2])
    if rope_pages is not None and (rope_pages.shape != (*pages, r) or rope_pages.dtype not in _QUERY_DTYPES):
        raise ValueError(f"rope_pages must be [P, page_size, R] = {(*pages, r)} in one of {_QUERY_DTYPES}, got "
                         f"{rope_pages.dtype} {tuple(rope_pages.shape)}")
    tiles = kv_scale.shape[2] if kv_scale is not None and kv_scale.dim() == 3 else 0
    if kv_scale is None:
        scales = "none"
    elif kv_pages.dtype != torch.float8_e4m3fn:
        raise ValueError(f"kv_scale is only for float8_e4m3fn pages, not {kv_pages.dtype}")
    elif kv_scale.dtype == torch.float32 and kv_scale.shape == pages and rope_pages is None:
        scales = "token"
    elif (kv_scale.dtype == torch.float32 and kv_scale.shape[:2] == pages and rope_pages is not None
          and 0 < tiles <= c and tiles & (tiles - 1) == 0):
        scales = "tile"
    else:
        raise ValueError(f"kv_scale must be fp32 [P, page_size] = {pages} (a scale per token), or with rope_pages "
                         f"[P, page_size, tiles] (a scale per C / tiles latent values, tiles a power of two <= C), "
                         f"got {kv_scale.dtype} {tuple(kv_scale.shape)}")
    if rope_pages is not None and scales != "tile":
        raise ValueError("rope_pages come with FP8 latent pages and their per-tile kv_scale [P, page_size, tiles]")
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be int32 [B={batch}, max_pages], got {page_table.dtype} "
                         f"{tuple(page_table.shape)}")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    tensors = [q_abs, q_pe, kv_pages, page_table, seq_lens] + [t for t in (kv_scale, rope_pages) if t is not None]
    check_same_device(*tensors)
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("the last dimension of every input must be contiguous (stride 1)")
    return batch, heads, c, r, scales


def mla_decode_paged(q_abs: torch.Tensor, q_pe: torch.Tensor, kv_pages: torch.Tensor,
                     kv_scale: torch.Tensor | None, page_table: torch.Tensor, seq_lens: torch.Tensor,
                     softmax_scale: float, *, rope_pages: torch.Tensor | None = None, num_splits: int | None = None,
                     block_h: int = 16, block_n: int = 32) -> torch.Tensor:
    """One decode step of absorbed MLA over a paged cache -> out [B, H, C] in q_abs.dtype (contiguous).

    q_abs [B, H, C] (query through W_UK), q_pe [B, H, R] (rotated rope query),
    page_table [B, max_pages] int32 (pages of each sequence in order; entries past its length are never read),
    seq_lens [B] int32 (>= 1, including the current token; values are not checked, to avoid a device sync),
    and one layer of the pool (`KVPool.data`'s parts), in one of these formats:
      kv_pages [P, page_size, C + R] fp32, bf16 or fp16, kv_scale None: plain pages;
      kv_pages [P, page_size, C + R] float8_e4m3fn, kv_scale None: FP8 tensor layout (the code is the value);
      kv_pages [P, page_size, C + R] float8_e4m3fn, kv_scale [P, page_size] fp32: FP8 token layout
        (true value = stored * the token's scale);
      kv_pages [P, page_size, C] float8_e4m3fn, kv_scale [P, page_size, tiles] fp32, rope_pages [P, page_size, R]
        bf16 (or fp16, fp32): FP8 tile layout (latent value = stored * the scale of its C / tiles values).
    num_splits chunks the sequence (flash-decoding); None picks it from the SM count.
    block_h heads and block_n tokens per tile: powers of two >= 16 (the smallest tl.dot on NVIDIA).
    """
    batch, heads, c, r, scales = _validate(q_abs, q_pe, kv_pages, kv_scale, rope_pages, page_table, seq_lens)
    check_dot_sizes(block_h=block_h, block_n=block_n)
    head_blocks = triton.cdiv(heads, block_h)
    splits = _default_splits(q_abs.device, batch * head_blocks) if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")

    dot_dtype, precision = dot_config(torch.bfloat16 if kv_pages.dtype == torch.float8_e4m3fn else kv_pages.dtype)

    out = torch.empty(batch, heads, c, dtype=q_abs.dtype, device=q_abs.device)
    if splits > 1:
        part_out = torch.empty(batch, splits, heads, c, dtype=torch.float32, device=q_abs.device)
        part_lse = torch.empty(batch, splits, heads, dtype=torch.float32, device=q_abs.device)
    else:
        part_out = part_lse = out                           # unused: the kernel writes `out` directly
    # placeholder pointers (never read) where a format has no scales or no rope pages of its own
    scale, rope = (kv_scale if kv_scale is not None else kv_pages), (rope_pages if rope_pages is not None else kv_pages)
    _mla_decode_kernel[(batch, head_blocks, splits)](
        q_abs, q_pe, kv_pages, scale, rope, page_table, seq_lens, out, part_out, part_lse,
        softmax_scale * _LOG2E, heads, q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_pages.stride(0), kv_pages.stride(1), scale.stride(0), scale.stride(1), rope.stride(0), rope.stride(1),
        page_table.stride(0), C=c, R=r, PAGE_SIZE=kv_pages.shape[1], BLOCK_H=block_h, BLOCK_N=block_n,
        NUM_SPLITS=splits, SCALES=scales, TILES=kv_scale.shape[2] if scales == "tile" else 1,
        DOT_DTYPE=dot_dtype, PRECISION=precision, num_warps=4, num_stages=2,
    )
    if splits > 1:
        _merge_splits_kernel[(batch, head_blocks)](part_out, part_lse, out, heads, C=c, BLOCK_H=block_h,
                                                   NUM_SPLITS=splits, num_warps=4)
    return out
