"""Weight formats of the released checkpoints, turned back into plain floating-point matrices.

- FP8 block (DeepSeek / GLM-5 FP8 releases): `float8_e4m3fn` weights with one fp32 `weight_scale_inv` per
  128x128 block; the real value is `w * scale_inv`.
- compressed-tensors `pack-quantized` INT4 (Kimi K2-Thinking / K2.5 / K2.6 routed experts): eight signed 4-bit
  values per int32 along the input dimension, stored offset by +8, with one scale per `group_size` inputs.
"""
from __future__ import annotations

import contextvars
import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from nano.errors import NanoError
from nano.kernels import triton_available

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = 448.0
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


def check_int4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
               weight_shape: torch.Tensor | Sequence[int], group_size: int) -> tuple[int, int]:
    """Validate a compressed-tensors INT4 triple; returns (N, K)."""
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
    return n, k


def unpack_int4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                weight_shape: torch.Tensor | Sequence[int], group_size: int) -> torch.Tensor:
    """compressed-tensors `pack-quantized` symmetric INT4 -> fp32 [N, K].

    weight_packed: int32 [N, ceil(K/8)], value k at bits 4*(k % 8) of word k // 8, stored as q + 8;
    weight_scale: [N, ceil(K/G)]; weight_shape: (N, K), which strips the padding of the last word.
    """
    n, k = check_int4(weight_packed, weight_scale, weight_shape, group_size)
    shifts = torch.arange(0, 4 * INT4_PER_INT32, 4, dtype=torch.int32, device=weight_packed.device)  # [8]
    nibbles = (weight_packed.unsqueeze(-1) >> shifts) & 0xF          # [N, K/8, 8], low nibble first
    q = nibbles.reshape(n, -1)[:, :k].float() - 8.0                  # [N, K] in -8..7
    scale = weight_scale.float().repeat_interleave(group_size, dim=1)[:, :k]  # [N, K]
    return q * scale


# ---- quantizing, and running, INT4 weights ----------------------------------------------------------------------

INT4_LEVEL = 7   # symmetric levels -7..7, as Kimi's QAT uses (the -8 code stays unused)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [N, K] -> compressed-tensors `pack-quantized` (weight_packed int32 [N, ceil(K/8)],
    weight_scale bf16 [N, ceil(K/G)]): round-to-nearest with one scale per group of G inputs."""
    if group_size not in (32, 64, 128):
        raise NanoError(f"INT4 group size must be 32, 64 or 128, got {group_size}")
    n, k = weight.shape
    groups = math.ceil(k / group_size)
    padded = torch.zeros(n, groups * group_size, dtype=torch.float32, device=weight.device)
    padded[:, :k] = weight.float()
    grouped = padded.view(n, groups, group_size)
    scale = (grouped.abs().amax(-1) / INT4_LEVEL).clamp(min=1e-12).to(torch.bfloat16)       # [N, K/G]
    q = (grouped / scale.float()[..., None]).round().clamp(-INT4_LEVEL, INT4_LEVEL)
    codes = (q.view(n, -1)[:, :k] + 8).to(torch.int32)                                       # [N, K] in 1..15
    words = torch.full((n, math.ceil(k / INT4_PER_INT32) * INT4_PER_INT32), 8, dtype=torch.int32,
                       device=weight.device)
    words[:, :k] = codes
    shifts = torch.arange(0, 4 * INT4_PER_INT32, 4, dtype=torch.int64, device=weight.device)
    packed = (words.view(n, -1, INT4_PER_INT32).long() << shifts).sum(-1)                   # [N, K/8] < 2^32
    return packed.to(torch.int32), scale   # the cast wraps bit 31 into the sign, as int32 storage does


_int4_mm_cpu = torch.ops.aten._weight_int4pack_mm_for_cpu   # [M, K] bf16 x tiled int4 [N, K] -> [M, N] bf16


class Int4Linear(torch.nn.Module):
    """y = x W^T with W kept as packed INT4 and dequantized inside the matmul (W4A16).

    On a GPU the compressed-tensors words go straight to the Triton W4A16 GEMM. A bfloat16 model on CPU
    repacks them once (exactly, no re-quantization) into PyTorch's tiled int4 layout for
    `_weight_int4pack_mm_for_cpu`, whose dequantization `(code - 8) * scale + zero` is the compressed-tensors
    one with zero = 0. A float32 model on CPU (the reference mode) unpacks the words and multiplies in fp32."""

    def __init__(self, weight_packed: torch.Tensor, weight_scale: torch.Tensor, shape: Sequence[int],
                 group_size: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.out_features, self.in_features = check_int4(weight_packed, weight_scale, shape, group_size)
        self.group_size = group_size
        n, k = self.out_features, self.in_features
        self.cpu_tiled = (not weight_packed.is_cuda and dtype == torch.bfloat16 and n % 16 == 0
                          and k % group_size == 0 and group_size in (32, 64, 128, 256))  # what the CPU kernel takes
        if self.cpu_tiled:
            shifts = torch.arange(0, 4 * INT4_PER_INT32, 4, dtype=torch.int32)
            codes = ((weight_packed.unsqueeze(-1) >> shifts) & 0xF).reshape(n, -1)[:, :k].contiguous()
            self.register_buffer("weight_tiled", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
            # [K/G, N, 2]: (scale, zero = 0) pairs, stored once (4 B per group instead of 2: 0.31x BF16, not 0.28x)
            scale_t = weight_scale.to(torch.bfloat16).t()
            self.register_buffer("scales_and_zeros", torch.stack([scale_t, torch.zeros_like(scale_t)], -1))
        else:
            self.register_buffer("weight_packed", weight_packed.contiguous())
            self.register_buffer("weight_scale", weight_scale.contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = 32) -> "Int4Linear":
        packed, scale = quantize_int4(weight, group_size)
        return cls(packed, scale, weight.shape, group_size, weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_tiled and x.dim() == 2 and x.dtype == torch.bfloat16:   # the decode hot path: no reshapes
            return _int4_mm_cpu(x, self.weight_tiled, self.group_size, self.scales_and_zeros)
        rows = x.reshape(-1, self.in_features)                                          # [M, K]
        if self.cpu_tiled:
            y = _int4_mm_cpu(rows.to(torch.bfloat16), self.weight_tiled, self.group_size, self.scales_and_zeros)
        elif rows.is_cuda and triton_available():
            from nano.kernels import w4a16_gemm
            y = w4a16_gemm(rows, self.weight_packed, self.weight_scale, self.group_size)
        else:  # fp32 on CPU, shapes the CPU kernel does not take, a GPU without triton: dequantize, then multiply
            w = unpack_int4(self.weight_packed, self.weight_scale, (self.out_features, self.in_features),
                            self.group_size)
            y = rows.float() @ w.t()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] this module stands for (fp32). On the CPU layout the kernel recovers the codes
        exactly (an identity input with unit scales gives code - 8, small integers that bf16 holds exactly)."""
        if not self.cpu_tiled:
            return unpack_int4(self.weight_packed, self.weight_scale, (self.out_features, self.in_features),
                               self.group_size)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        unit = torch.zeros_like(self.scales_and_zeros)
        unit[..., 0] = 1
        codes = _int4_mm_cpu(eye, self.weight_tiled, self.group_size, unit)  # [K, N]
        scale = self.scales_and_zeros[..., 0].float().repeat_interleave(self.group_size, dim=0)            # [K, N]
        return (codes.float() * scale).t().contiguous()


# ---- choosing formats for a model -------------------------------------------------------------------------------

WEIGHT_FORMATS = ("auto", "bf16", "fp8", "int4")
_ROUTED_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
# logits, routers, and kv_b_proj (absorbed into MLA's query and output sides as a matrix) stay as they are
_KEEP_HIGH_PRECISION = re.compile(r"(lm_head|.*\.mlp\.gate|.*\.indexer\.weights_proj|.*\.kv_b_proj)")


def quantize_fp8_block(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [N, K] -> (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N/b), ceil(K/b)]), the GLM-5 FP8 layout."""
    n, k = weight.shape
    rows, cols = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(rows * block, cols * block, device=weight.device)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, block, cols, block)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)                    # [N/b, K/b]
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * block, cols * block)[:n, :k].contiguous(), scale_inv


_DECODE_PHASE = contextvars.ContextVar("nano_decode_phase", default=False)


@contextmanager
def weight_phase(decode: bool) -> Iterator[None]:
    """Inside the block, every PhaseLinear runs its decode (True) or prefill (False) weights. The model enters it
    once per forward pass, from the pass's `ForwardBatch.decode`."""
    token = _DECODE_PHASE.set(decode)
    try:
        yield
    finally:
        _DECODE_PHASE.reset(token)


class PhaseLinear(torch.nn.Module):
    """One Linear held in two formats: e.g. BF16 for compute-bound prefill, INT4 for bandwidth-bound decode."""

    def __init__(self, prefill: torch.nn.Module, decode: torch.nn.Module) -> None:
        super().__init__()
        self.prefill, self.decode = prefill, decode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(x) if _DECODE_PHASE.get() else self.prefill(x)


def _in_format(linear: torch.nn.Module, weights: str, dtype: torch.dtype, group_size: int) -> torch.nn.Module:
    """`linear` (an nn.Linear, or an Int4Linear from a packed checkpoint) as a module computing in `weights`."""
    if weights == "int4":
        return linear if isinstance(linear, Int4Linear) else Int4Linear.from_float(linear.weight.data, group_size)
    weight = linear.dequantized().to(dtype) if isinstance(linear, Int4Linear) else linear.weight.data
    if weights == "fp8":
        weight = dequantize_fp8_block(*quantize_fp8_block(weight)).to(dtype)
    dense = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    dense.weight = torch.nn.Parameter(weight, requires_grad=False)
    return dense


def convert_weights(model: torch.nn.Module, prefill: str, decode: str, dtype: torch.dtype, int4_all: bool = False,
                    group_size: int = 32) -> None:
    """Put the model's Linear layers into the requested formats, in place: the routed experts by default (as
    Kimi ships them), every Linear but the lm_head, routers and kv_b_proj with `int4_all`.

    "int4" is Int4Linear (packed, 0.28x the bytes of BF16 at G = 32). "fp8" rounds the weights to FP8
    128x128 blocks and dequantizes them once, here: CPUs have no FP8 matmul, so the model computes with FP8's
    values in its own dtype. "bf16" is the model's own dtype (and unpacks an INT4 checkpoint); "auto" keeps
    what the checkpoint holds. When prefill and decode differ, each layer keeps both (PhaseLinear)."""
    for name, fmt in (("prefill_weights", prefill), ("decode_weights", decode)):
        if fmt not in WEIGHT_FORMATS:
            raise NanoError(f"{name} must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
    if prefill == decode == "auto":
        return
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, (torch.nn.Linear, Int4Linear)) and not _KEEP_HIGH_PRECISION.match(name)
               and (int4_all or _ROUTED_EXPERT.match(name))]
    for name, linear in targets:
        variants = {fmt: linear if fmt == "auto" else _in_format(linear, fmt, dtype, group_size)
                    for fmt in {prefill, decode}}
        parent_name, _, attr = name.rpartition(".")
        converted = variants[prefill] if prefill == decode else PhaseLinear(variants[prefill], variants[decode])
        setattr(model.get_submodule(parent_name), attr, converted)


def weight_bytes_by_format(model: torch.nn.Module) -> dict[str, int]:
    """Resident weight bytes grouped by storage format ("int4" counts packed codes and scales)."""
    totals: dict[str, int] = {}
    for module in model.modules():
        fmt = "int4" if isinstance(module, Int4Linear) else None
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if not tensor.is_floating_point() and fmt is None or tensor.device.type == "meta":
                continue
            key = fmt or {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(
                tensor.dtype, str(tensor.dtype))
            totals[key] = totals.get(key, 0) + tensor.numel() * tensor.element_size()
    return totals
