"""Weight formats of the released checkpoints, turned back into plain floating-point matrices.

- FP8 block (DeepSeek / GLM-5 FP8 releases): `float8_e4m3fn` weights with one fp32 `weight_scale_inv` per
  128x128 block; the real value is `w * scale_inv`.
- compressed-tensors `pack-quantized` INT4 (Kimi K2-Thinking / K2.5 / K2.6 routed experts): eight signed 4-bit
  values per int32 along the input dimension, stored offset by +8, with one scale per `group_size` inputs.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nano.errors import NanoError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT4_PER_INT32 = 8


def _shape(t: torch.Tensor | Sequence[int]) -> tuple[int, ...]:
    return tuple(int(d) for d in t)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: Sequence[int] = (128, 128)) -> torch.Tensor:
    """FP8 weight [N, K] times its per-block `scale_inv` [ceil(N/bn), ceil(K/bk)] -> fp32 [N, K]."""
    if weight.dtype not in FP8_DTYPES:
        raise NanoError(f"FP8 block weight must be float8, got {weight.dtype}")
    if weight.dim() != 2 or len(block) != 2 or min(block) < 1:
        raise NanoError(f"FP8 block dequant needs a 2-D weight and a 2-D block, got weight {_shape(weight.shape)} "
                        f"and block {tuple(block)}")
    (n, k), (bn, bk) = weight.shape, block
    expected = (math.ceil(n / bn), math.ceil(k / bk))
    if _shape(scale_inv.shape) != expected:
        raise NanoError(f"FP8 weight of shape {(n, k)} with {bn}x{bk} blocks needs weight_scale_inv of shape "
                        f"{expected}, got {_shape(scale_inv.shape)}")
    # scale [N/bn, K/bk] -> one scale per element [N, K]; the last block row/column may be partial
    scale = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.float() * scale


def unpack_int4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                weight_shape: torch.Tensor | Sequence[int], group_size: int) -> torch.Tensor:
    """compressed-tensors `pack-quantized` symmetric INT4 -> fp32 [N, K].

    weight_packed: int32 [N, ceil(K/8)], value k at bits 4*(k % 8) of word k // 8, stored as q + 8;
    weight_scale: [N, ceil(K/G)]; weight_shape: (N, K), which strips the padding of the last word.
    """
    if len(weight_shape) != 2:
        raise NanoError(f"INT4 weight_shape must be (N, K), got {_shape(weight_shape)}")
    n, k = _shape(weight_shape)
    if group_size < 1:
        raise NanoError(f"INT4 group_size must be positive, got {group_size}")
    if weight_packed.dtype != torch.int32:
        raise NanoError(f"INT4 weight_packed must be int32, got {weight_packed.dtype}")
    expected_packed = (n, math.ceil(k / INT4_PER_INT32))
    if _shape(weight_packed.shape) != expected_packed:
        raise NanoError(f"INT4 weight of shape {(n, k)} needs weight_packed of shape {expected_packed}, "
                        f"got {_shape(weight_packed.shape)}")
    expected_scale = (n, math.ceil(k / group_size))
    if _shape(weight_scale.shape) != expected_scale:
        raise NanoError(f"INT4 weight of shape {(n, k)} with group size {group_size} needs weight_scale of shape "
                        f"{expected_scale}, got {_shape(weight_scale.shape)}")
    shifts = torch.arange(0, 4 * INT4_PER_INT32, 4, dtype=torch.int32, device=weight_packed.device)  # [8]
    nibbles = (weight_packed.unsqueeze(-1) >> shifts) & 0xF          # [N, K/8, 8], low nibble first
    q = nibbles.reshape(n, -1)[:, :k].float() - 8.0                  # [N, K] in -8..7
    scale = weight_scale.float().repeat_interleave(group_size, dim=1)[:, :k]  # [N, K]
    return q * scale
