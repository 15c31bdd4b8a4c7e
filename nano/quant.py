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
import torch.nn.functional as F

from nano.errors import NanoError
from nano.kernels import triton_available
from nano.settings import WEIGHT_FORMATS

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = 448.0
INT4_PER_INT32 = 8


def _shape(t: torch.Tensor | Sequence[int]) -> tuple[int, ...]:
    return tuple(int(d) for d in t)


def _check_shape(weight: str, name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if _shape(tensor.shape) != expected:
        raise NanoError(f"{weight} needs {name} of shape {expected}, got {_shape(tensor.shape)}")


def as_parameter(bias: torch.Tensor | None) -> torch.nn.Parameter | None:
    """A Linear's bias as a frozen Parameter (the same object when it is one already: a loader may fill it later)."""
    if bias is None or isinstance(bias, torch.nn.Parameter):
        return bias
    return torch.nn.Parameter(bias, requires_grad=False)


def check_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int]) -> tuple[int, int]:
    """Validate an FP8 block pair (weight [N, K] float8, scale_inv [ceil(N/bn), ceil(K/bk)]); returns (N, K)."""
    if weight.dtype not in FP8_DTYPES:
        raise NanoError(f"FP8 block weight must be float8, got {weight.dtype}")
    if weight.dim() != 2 or len(block) != 2 or min(block) < 1:
        raise NanoError(f"FP8 block dequant needs a 2-D weight and a 2-D block, got weight {_shape(weight.shape)} "
                        f"and block {tuple(block)}")
    (n, k), (bn, bk) = weight.shape, block
    _check_shape(f"FP8 weight of shape {(n, k)} with {bn}x{bk} blocks", "weight_scale_inv", scale_inv,
                 (math.ceil(n / bn), math.ceil(k / bk)))
    return n, k


def e4m3_bits(codes: torch.Tensor, dtype: torch.dtype, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """float8_e4m3fn codes [...] -> the same values as float16 (times 2^-8) or bfloat16 (times 2^-120), exactly,
    with integer ops: CPUs have no fast FP8 conversion (`.float()` costs about 2 ns per element here, this 0.1 ns).

    e4m3 is sign | 4 exponent bits (bias 7) | 3 mantissa bits. Shifted left by 7 the byte reads as float16 (5
    exponent bits, bias 15) worth value * 2^-8; shifted left by 4 as bfloat16 (8 exponent bits, bias 127) worth
    value * 2^-120; subnormals included. The int8 view sign-extends; the mask keeps the sign bit and drops the
    copies of it the shift left behind. e4m3fn's NaN code is not mapped (the loader and the KV writer never store
    it). `scratch`, int16 of the codes' shape, receives the result instead of a new tensor."""
    bits = torch.empty(codes.shape, dtype=torch.int16, device=codes.device) if scratch is None else scratch
    bits.copy_(codes.view(torch.int8))                                                   # sign-extended
    if dtype == torch.float16:
        return bits.bitwise_left_shift_(7).bitwise_and_(-0x4080).view(torch.float16)     # 0xBF80
    return bits.bitwise_left_shift_(4).bitwise_and_(-0x7810).view(torch.bfloat16)        # 0x87F0


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int] = (128, 128),
                         dtype: torch.dtype = torch.float32, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 weight [N, K] times its per-block `scale_inv` [ceil(N/bn), ceil(K/bk)] -> [N, K] in `dtype`: exactly
    `weight.float() * scale` (one rounding) cast to `dtype`, except for bfloat16, below.

    e4m3fn codes become 16-bit floats by integer ops (`e4m3_bits`); the power of two goes into the scale. For
    bfloat16 the product is taken in bfloat16 (the scale rounded to bfloat16 first): two roundings instead of one
    (measured: at most 0.6% relative, 1.5 bfloat16 ulps), and no fp32 pass, which matters because the CPU's FP8
    matmul pays this at every call. e5m2 converts directly.

    `scratch`, int16 with at least N rows of K, holds the codes instead of a new tensor (for bfloat16 the result is
    a view of it: use it before reusing the scratch)."""
    n, k = check_fp8_block(weight, scale_inv, block)
    bn, bk = block
    if weight.dtype == torch.float8_e4m3fn:
        scratch = None if scratch is None else scratch[:n]
        if dtype == torch.bfloat16 and scale_inv.max() < 2.0 ** 7:                      # * 2^120 stays finite
            values = e4m3_bits(weight, torch.bfloat16, scratch)                          # value * 2^-120
            scale = (scale_inv.float() * 2.0 ** 120).to(torch.bfloat16)                 # [N/bn, K/bk]
        else:
            values = e4m3_bits(weight, torch.float16, scratch).float()                   # value * 2^-8
            scale = scale_inv.float() * 256.0
    else:
        values, scale = weight.float(), scale_inv.float()
    if n % bn == 0 and k % bk == 0:   # each block's scale over its [bn, bk] tile, in place (values is ours)
        values.view(n // bn, bn, k // bk, bk).mul_(scale[:, None, :, None])
        return values.to(dtype)
    # the last block row/column is partial: one scale per element [N, K]
    return (values * scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]).to(dtype)


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
    _check_shape(f"INT4 weight of shape {(n, k)}", "weight_packed", weight_packed, (n, math.ceil(k / INT4_PER_INT32)))
    _check_shape(f"INT4 weight of shape {(n, k)} with group size {group_size}", "weight_scale", weight_scale,
                 (n, math.ceil(k / group_size)))
    return n, k


def unpack_int4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                weight_shape: torch.Tensor | Sequence[int], group_size: int) -> torch.Tensor:
    """compressed-tensors `pack-quantized` symmetric INT4 -> fp32 [N, K].

    weight_packed: int32 [N, ceil(K/8)], value k at bits 4*(k % 8) of word k // 8, stored as q + 8;
    weight_scale: [N, ceil(K/G)]; weight_shape: (N, K), which strips the padding of the last word.
    """
    _, k = check_int4(weight_packed, weight_scale, weight_shape, group_size)
    q = _int4_codes(weight_packed, k).float() - 8.0                  # [N, K] in -8..7
    scale = weight_scale.float().repeat_interleave(group_size, dim=1)[:, :k]  # [N, K]
    return q * scale


def _int4_codes(weight_packed: torch.Tensor, k: int) -> torch.Tensor:
    """Packed words [N, ceil(K/8)] -> the codes they store, q + 8 [N, K] (int32 in 0..15)."""
    shifts = torch.arange(0, 4 * INT4_PER_INT32, 4, dtype=torch.int32, device=weight_packed.device)  # [8]
    return ((weight_packed.unsqueeze(-1) >> shifts) & 0xF).flatten(1)[:, :k]  # [N, K/8, 8] (low nibble first)


# ---- quantizing, and running, INT4 weights ----------------------------------------------------------------------

INT4_LEVEL = 7   # symmetric levels -7..7, as Kimi's QAT uses (the -8 code stays unused)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [N, K] -> compressed-tensors `pack-quantized` (weight_packed int32 [N, ceil(K/8)],
    weight_scale bf16 [N, ceil(K/G)]): round-to-nearest with one scale per group of G inputs."""
    if group_size not in (32, 64, 128):
        raise NanoError(f"INT4 group size must be 32, 64 or 128, got {group_size}")
    n, k = weight.shape
    grouped = F.pad(weight.float(), (0, -k % group_size)).view(n, -1, group_size)           # [N, K/G, G]
    scale = (grouped.abs().amax(-1) / INT4_LEVEL).clamp(min=1e-12).to(torch.bfloat16)       # [N, K/G]
    q = (grouped / scale.float()[..., None]).round().clamp(-INT4_LEVEL, INT4_LEVEL)
    codes = (q.view(n, -1)[:, :k] + 8).to(torch.int32)                                       # [N, K] in 1..15
    words = F.pad(codes, (0, -k % INT4_PER_INT32), value=8)          # [N, K/8 * 8], the padding's code is 0 + 8
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
                 group_size: int, dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_parameter("bias", as_parameter(bias))
        self.out_features, self.in_features = check_int4(weight_packed, weight_scale, shape, group_size)
        self.group_size = group_size
        n, k = self.out_features, self.in_features
        self.cpu_tiled = (not weight_packed.is_cuda and dtype == torch.bfloat16 and n % 16 == 0
                          and k % group_size == 0 and group_size in (32, 64, 128, 256))  # what the CPU kernel takes
        if self.cpu_tiled:
            codes = _int4_codes(weight_packed, k).contiguous()
            self.register_buffer("weight_tiled", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
            # [K/G, N, 2]: (scale, zero = 0) pairs, stored once (4 B per group instead of 2: 0.31x BF16, not 0.28x)
            scale_t = weight_scale.to(torch.bfloat16).t()
            self.register_buffer("scales_and_zeros", torch.stack([scale_t, torch.zeros_like(scale_t)], -1))
        else:
            self.register_buffer("weight_packed", weight_packed.contiguous())
            self.register_buffer("weight_scale", weight_scale.contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = 32, bias: torch.Tensor | None = None) -> "Int4Linear":
        packed, scale = quantize_int4(weight, group_size)
        return cls(packed, scale, weight.shape, group_size, weight.dtype, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_tiled and x.dim() == 2 and x.dtype == torch.bfloat16:   # the decode hot path: no reshapes
            y = _int4_mm_cpu(x, self.weight_tiled, self.group_size, self.scales_and_zeros)
        else:
            y = self._matmul(x.reshape(-1, self.in_features)).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] -> rows @ W.T [M, N]."""
        if self.cpu_tiled:
            return _int4_mm_cpu(rows.to(torch.bfloat16), self.weight_tiled, self.group_size, self.scales_and_zeros)
        if rows.is_cuda and triton_available():
            from nano.kernels import w4a16_gemm
            return w4a16_gemm(rows, self.weight_packed, self.weight_scale, self.group_size)
        # fp32 on CPU, shapes the CPU kernel does not take, a GPU without triton: dequantize, then multiply
        return rows.float() @ self.dequantized().t()

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


# ---- quantizing, and running, FP8 block weights ----------------------------------------------------------------

def quantize_fp8_block(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [N, K] -> (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N/b), ceil(K/b)]), the GLM-5 FP8 layout:
    one scale per b x b block, amax / 448, so that the block's largest value lands on e4m3's largest."""
    n, k = weight.shape
    rows, cols = math.ceil(n / block), math.ceil(k / block)
    blocks = F.pad(weight.float(), (0, cols * block - k, 0, rows * block - n)).view(rows, block, cols, block)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)                    # [N/b, K/b]
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * block, cols * block)[:n, :k].contiguous(), scale_inv


FP8_SLICE_ELEMENTS = 2 ** 20   # weights dequantized at a time on CPU (2 MB as int16 codes: it stays in cache)


class Fp8Linear(torch.nn.Module):
    """y = x W^T with W kept as FP8 e4m3 blocks (the DeepSeek-V3 / GLM-5 FP8 release layout), 1 byte per weight plus
    one fp32 scale per 128x128 block: 0.50x the bytes of BF16 (+0.01% for the scales).

    The buffers carry the checkpoint's own names and dtypes: `weight` float8_e4m3fn [N, K] and `weight_scale_inv`
    fp32 [ceil(N/bn), ceil(K/bk)]. On a GPU the Triton FP8 GEMM dequantizes weight tiles in registers. On CPU, which
    has no FP8 arithmetic, every call dequantizes the weight, a slice at a time, into the activations' dtype and
    multiplies: FP8 on CPU is for memory and correctness, not speed (docs/fp8.md has the measured cost)."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: Sequence[int] = (128, 128),
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = check_fp8_block(weight, weight_scale_inv, block_size)
        self.block_size = (int(block_size[0]), int(block_size[1]))
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale_inv", weight_scale_inv.float().contiguous())
        self.register_parameter("bias", as_parameter(bias))
        # the K tile of the Triton FP8 kernels: the largest of 64, 32, 16 dividing bk (a tile must lie in one scale
        # column), or None when none does (the layer then dequantizes, then multiplies)
        self.kernel_block_k = next((tile for tile in (64, 32, 16) if self.block_size[1] % tile == 0), None)

    @classmethod
    def from_float(cls, weight: torch.Tensor, block: int = 128, bias: torch.Tensor | None = None) -> "Fp8Linear":
        return cls(*quantize_fp8_block(weight, block), (block, block), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)                                          # [M, K]
        if rows.is_cuda and triton_available() and self.kernel_block_k is not None:
            from nano.kernels import fp8_gemm
            y = fp8_gemm(rows, self.weight, self.weight_scale_inv, self.block_size, block_k=self.kernel_block_k)
        else:
            y = self._dequantize_and_multiply(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _dequantize_and_multiply(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] @ W.T -> [M, N], W dequantized a slice of whole block rows at a time (about 2 MB of codes:
        128 output rows at a Kimi expert's K = 7168, all of a small layer at once): each slice of W is used while
        it is still in cache. Dequantizing all of W first and then multiplying measured 4-10x slower here at one
        Kimi expert's shape (30 MB temporaries that go to memory and back)."""
        bn = self.block_size[0]
        rows_per_slice = bn * max(1, FP8_SLICE_ELEMENTS // (self.in_features * bn))    # whole block rows
        out = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype, device=rows.device)
        # one buffer for every slice's codes: a fresh 2 MB tensor per slice would be fresh pages (faults) each time
        scratch = torch.empty(min(rows_per_slice, self.out_features), self.in_features, dtype=torch.int16,
                              device=rows.device)
        for first in range(0, self.out_features, rows_per_slice):
            last = min(first + rows_per_slice, self.out_features)
            w = dequantize_fp8_block(self.weight[first:last], self.weight_scale_inv[first // bn:-(-last // bn)],
                                     self.block_size, rows.dtype, scratch)             # [slice, K]
            out[:, first:last] = rows @ w.t()
        return out

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] this module stands for (fp32)."""
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block_size)


# ---- choosing formats for a model -------------------------------------------------------------------------------

_ROUTED_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
# logits, routers, the indexer's head weights and kv_b_proj (absorbed into MLA's query and output sides as a matrix)
# stay in the model's dtype
_KEEP_HIGH_PRECISION = re.compile(r"lm_head|.*\.mlp\.gate|.*\.indexer\.weights_proj|.*\.kv_b_proj")


def keeps_high_precision(module_name: str) -> bool:
    """Whether nano computes this Linear in the model's dtype whatever the weight format (an FP8 checkpoint's
    kv_b_proj is dequantized at load: the model reads it as a matrix, not through a matmul call)."""
    return _KEEP_HIGH_PRECISION.fullmatch(module_name) is not None


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


QUANTIZED_LINEARS = (Int4Linear, Fp8Linear)


def _dense_weight(linear: torch.nn.Module) -> torch.Tensor:
    return linear.dequantized() if isinstance(linear, QUANTIZED_LINEARS) else linear.weight.data


def _in_format(linear: torch.nn.Module, weights: str, dtype: torch.dtype, group_size: int) -> torch.nn.Module:
    """`linear` (an nn.Linear, or an Int4Linear / Fp8Linear from a quantized checkpoint) as a module computing in
    `weights` ("bf16" meaning the model's own dtype)."""
    if weights == "int4":
        return linear if isinstance(linear, Int4Linear) else Int4Linear.from_float(
            _dense_weight(linear).to(dtype), group_size, linear.bias)
    if weights == "fp8":
        return linear if isinstance(linear, Fp8Linear) else Fp8Linear.from_float(
            _dense_weight(linear).to(dtype), bias=linear.bias)
    if isinstance(linear, torch.nn.Linear):
        return linear
    weight = _dense_weight(linear).to(dtype)
    dense = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    dense.weight = torch.nn.Parameter(weight, requires_grad=False)
    dense.bias = linear.bias
    return dense


def not_converted(name: str, patterns: Sequence[str]) -> bool:
    """Whether module `name` is on a checkpoint's list of modules kept unquantized: compressed-tensors `ignore`
    entries ("re:REGEX" matched from the start of the name, or exact names) and Hugging Face
    `modules_to_not_convert` entries (a dotted part of the name, e.g. "lm_head" or "self_attn")."""
    return any(re.match(pattern[3:], name) is not None if pattern.startswith("re:") else f".{pattern}." in f".{name}."
               for pattern in patterns)


def unquantized_modules(quantization_config: dict | None) -> list[str]:
    """The checkpoint's list of modules it keeps in high precision (both spellings), [] without one."""
    qc = quantization_config or {}
    names = [*(qc.get("ignore") or []), *(qc.get("modules_to_not_convert") or [])]
    if not all(isinstance(n, str) for n in names):
        raise NanoError("quantization_config ignore / modules_to_not_convert must be lists of module names")
    return names


def convert_weights(model: torch.nn.Module, prefill: str, decode: str, dtype: torch.dtype, int4_all: bool = False,
                    group_size: int = 32, keep: Sequence[str] = ()) -> None:
    """Put the model's Linear layers into the requested formats, in place.

    What each format touches: "fp8" every Linear but the lm_head, the routers, the indexer's weights_proj and
    kv_b_proj (which MLA absorbs as a matrix), as the FP8 releases do, held as Fp8Linear (0.50x BF16);
    "int4" the routed experts (as Kimi ships them; every Linear "fp8" touches with `int4_all`), held as Int4Linear
    (0.28x BF16 at G = 32); "bf16" every Linear, in the model's own dtype (unpacking a quantized checkpoint);
    "auto" nothing: what the checkpoint holds. Modules named in `keep` (the checkpoint's `ignore` /
    `modules_to_not_convert`, see `not_converted`) are never converted.

    Each phase's format applies to what it touches; for that phase the rest stays as loaded. When the two phases
    end up in different formats, the layer keeps both (PhaseLinear). So `--prefill-weights fp8 --decode-weights
    int4` prefills with every Linear FP8 and decodes with INT4 experts and everything else as the checkpoint holds
    it (FP8 for an FP8 release: one copy; BF16 for a BF16 one: attention held twice) — exactly what the split's
    two workers, each given only its own format, compute."""
    for name, fmt in (("prefill_weights", prefill), ("decode_weights", decode)):
        if fmt not in WEIGHT_FORMATS:
            raise NanoError(f"{name} must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")

    def touches(fmt: str, name: str) -> bool:
        if fmt == "auto":
            return False
        if fmt == "int4" and not int4_all:
            return _ROUTED_EXPERT.fullmatch(name) is not None
        return fmt == "bf16" or not keeps_high_precision(name)

    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, (torch.nn.Linear, *QUANTIZED_LINEARS)) and not not_converted(name, keep)]
    for name, linear in targets:
        on_prefill = prefill if touches(prefill, name) else "auto"
        on_decode = decode if touches(decode, name) else "auto"
        if on_prefill == on_decode == "auto":
            continue
        variants = {fmt: linear if fmt == "auto" else _in_format(linear, fmt, dtype, group_size)
                    for fmt in {on_prefill, on_decode}}
        parent_name, _, attr = name.rpartition(".")
        prefill_side, decode_side = variants[on_prefill], variants[on_decode]
        # one module when both phases run the same one (fp8 prefill over an FP8 release's attention)
        converted = prefill_side if prefill_side is decode_side else PhaseLinear(prefill_side, decode_side)
        setattr(model.get_submodule(parent_name), attr, converted)


def weight_bytes_by_format(model: torch.nn.Module) -> dict[str, int]:
    """Resident weight bytes grouped by storage format ("int4" and "fp8" count codes and scales)."""
    totals: dict[str, int] = {}
    for module in model.modules():
        fmt = "int4" if isinstance(module, Int4Linear) else "fp8" if isinstance(module, Fp8Linear) else None
        tensors = [(tensor, None) for tensor in module.parameters(recurse=False)]     # a quantized Linear's bias too
        tensors += [(tensor, fmt) for tensor in module.buffers(recurse=False)]
        for tensor, tensor_fmt in tensors:
            if not tensor.is_floating_point() and tensor_fmt is None or tensor.device.type == "meta":
                continue
            key = tensor_fmt or {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(
                tensor.dtype, str(tensor.dtype))
            totals[key] = totals.get(key, 0) + tensor.numel() * tensor.element_size()
    return totals
