"""The quantized-weight GEMM and fused-MoE Triton kernels (INT4 and FP8 weights) against dequantize-then-matmul
references in float64, and the fused MoE in the engine against the torch path.

The weights are built here, independently of nano: INT4 packed in the compressed-tensors `pack-quantized` layout
(its padding nibbles hold 0, value -8, not the 8 = value 0 that checkpoints store, so a kernel that read past K
would show), FP8 quantized per (bn, bk) block by a loop over the blocks, with block magnitudes spread over 2^-4
to 2^4 so that a wrong scale block shows. Shapes put N and K off the blocks (partial last blocks). Without CUDA
the kernels run in Triton's interpreter, in a child process, as in test_kernels.py (TRITON_INTERPRET must be set
before triton is first imported). Shapes stay small: the interpreter takes milliseconds per tile step.
"""
from __future__ import annotations

import importlib
import math
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch
from fixtures import KERNELS_HERE, rerun_under_interpreter, runs_kernels
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_MAX = 448.0
# Relative error bounds (max |out - ref| / max |ref|).
# fp32 activations: the kernel's only roundings are one fp32 product per dequantized weight and the fp32 sums of
# K terms (ieee tl.dot on GPU); their typical relative size is about sqrt(K) * 2^-24 < 1e-6, so 1e-5 has margin
# and still catches a wrong scale or a dropped tile, which are errors of order 1.
FP32_TOLERANCE = 1e-5
# 16-bit activations: the interpreter computes in fp32 and rounds each stored result once (truncating): one ulp.
# On GPU the products and results are 16-bit (and the dequantized weights are rounded to 16 bits before tl.dot).
ULP = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
GPU_16BIT_TOLERANCE = 3e-2


def tolerance(x_dtype: torch.dtype, roundings: int = 1) -> float:
    """The bound for activations of x_dtype, for a result rounded to x_dtype `roundings` times on the way."""
    if x_dtype == torch.float32:
        return FP32_TOLERANCE
    return roundings * ULP[x_dtype] if DEVICE == "cpu" else GPU_16BIT_TOLERANCE


@pytest.fixture(scope="module")
def gemm() -> ModuleType:
    pytest.importorskip("triton", reason="triton is not installed")
    return importlib.import_module("nano.kernels.gemm")


@pytest.fixture(scope="module")
def moe() -> ModuleType:
    pytest.importorskip("triton", reason="triton is not installed")
    return importlib.import_module("nano.kernels.moe")


@pytest.mark.skipif(KERNELS_HERE, reason="the kernel tests run in this process")
def test_under_interpreter() -> None:
    rerun_under_interpreter(__file__)


def test_lazy_exports_resolve() -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    kernels = importlib.import_module("nano.kernels")
    for name in kernels._LAZY_EXPORTS:
        assert callable(getattr(kernels, name))


# --- INT4 (compressed-tensors pack-quantized) ---

def pack(q: torch.Tensor) -> torch.Tensor:
    """q int [N, K] in -8..7 -> int32 [N, ceil(K/8)]: element k as q + 8 in bits 4*(k % 8) of word k // 8."""
    n, k = q.shape
    nibbles = torch.zeros(n, math.ceil(k / 8) * 8, dtype=torch.int64)                  # padding nibbles: 0
    nibbles[:, :k] = q + 8
    words = torch.zeros(n, nibbles.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        words += nibbles[:, j::8] << (4 * j)                                           # [N, K/8] in [0, 2^32)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def random_int4_weight(n: int, k: int, group: int, scale_dtype: torch.dtype, gen: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random INT4 weight [N, K] -> (packed int32 [N, ceil(K/8)], scale [N, ceil(K/G)], dequantized fp64)."""
    q = torch.randint(-8, 8, (n, k), generator=gen)
    scale = (torch.rand(n, math.ceil(k / group), generator=gen) * 0.1 + 0.01).to(scale_dtype)
    dequant = q.double() * scale.double().repeat_interleave(group, dim=1)[:, :k]
    return pack(q), scale, dequant


def test_packer_agrees_with_nano_reference_dequant() -> None:
    from nano.quant import unpack_int4
    gen = torch.Generator().manual_seed(0)
    for k in (64, 203):
        packed, scale, dequant = random_int4_weight(5, k, 32, torch.float32, gen)
        torch.testing.assert_close(unpack_int4(packed, scale, (5, k), 32), dequant.float(), rtol=0, atol=0)


# --- FP8 (float8_e4m3fn codes, fp32 scale_inv per (bn, bk) block) ---

def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes float8_e4m3fn [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)]), block by block:
    scale = amax / 448, codes = w / scale rounded to e4m3."""
    bn, bk = block
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(n / bn), math.ceil(k / bk), dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            scale[i, j] = w[rows, cols].abs().max() / FP8_MAX
            codes[rows, cols] = (w[rows, cols] / scale[i, j]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W[n, k] = codes[n, k] * scale[n // bn, k // bk] in float64 (exact: 4 + 24 significant bits)."""
    n, k = codes.shape
    full = scale.double().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:n, :k]
    return codes.double() * full


def random_fp8_weight(n: int, k: int, block: tuple[int, int], gen: torch.Generator
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random FP8 weight [N, K] whose blocks differ in magnitude (2^-4 to 2^4) -> (codes, scale_inv, fp64)."""
    magnitude = 2 ** (torch.rand(math.ceil(n / block[0]), math.ceil(k / block[1]), generator=gen) * 8 - 4)
    magnitude = magnitude.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:n, :k]  # [N, K]
    w = torch.randn(n, k, generator=gen) * magnitude
    codes, scale = quantize_fp8(w, block)
    return codes, scale, dequantize_fp8(codes, scale, block)


def test_fp8_quantizer_round_trips() -> None:
    """The test's quantizer: e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4), partial blocks included."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 70, generator=gen)
    codes, scale = quantize_fp8(w, (16, 32))
    assert codes.shape == (40, 70) and scale.shape == (3, 3)
    dequant = dequantize_fp8(codes, scale, (16, 32))
    assert ((dequant - w.double()).abs() <= 2 ** -4 * w.double().abs() + 2 ** -9 * scale.max()).all()
    assert codes.float().abs().amax() == FP8_MAX                                       # each block's max hits 448


def in_nan_rows(t: torch.Tensor, extra: int) -> torch.Tensor:
    """t [R, C] as a view into rows of C + extra values whose tail is NaN: a kernel that read past C would show."""
    rows = torch.full((t.shape[0], t.shape[1] + extra), float("nan"), device=t.device).to(t.dtype)
    rows[:, :t.shape[1]] = t
    return rows[:, :t.shape[1]]


def random_weight(weight_format: str, n: int, k: int, gen: torch.Generator
                  ) -> tuple[tuple[torch.Tensor, torch.Tensor, int | tuple[int, int]], torch.Tensor]:
    """((codes, scales, group size or block), dequantized fp64) in a small layout of each format."""
    if weight_format == "int4":
        packed, scale, dequant = random_int4_weight(n, k, 32, torch.bfloat16, gen)
        return (packed, scale, 32), dequant
    codes, scale, dequant = random_fp8_weight(n, k, (32, 64), gen)                  # bk: a multiple of block_k=64
    return (codes, scale, (32, 64)), dequant


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.cpu().double() - ref).abs().max() / ref.abs().max()).item()


# --- dense GEMM ---

# (M, N, K, group size, split_k, block_k, x dtype, scale dtype): N, K off the 64 blocks; K = 200 is ragged in
# groups, 203 also in words; block_k above, at and below the group size.
INT4_GEMM_CASES = [
    (1, 200, 256, 32, 1, 64, torch.float32, torch.bfloat16),
    (1, 200, 256, 128, 3, 64, torch.float32, torch.float32),
    (7, 130, 200, 32, 8, 64, torch.float32, torch.bfloat16),                           # split_k > K tiles
    (7, 96, 203, 32, 1, 32, torch.float32, torch.float16),
    (64, 72, 203, 128, 4, 32, torch.float32, torch.bfloat16),
    (64, 64, 96, 64, 1, 128, torch.float32, torch.bfloat16),
    (13, 100, 160, 32, 2, 64, torch.bfloat16, torch.bfloat16),
    (1, 64, 136, 128, 1, 64, torch.float16, torch.bfloat16),
]


@runs_kernels
@pytest.mark.parametrize("m,n,k,group,split_k,block_k,x_dtype,scale_dtype", INT4_GEMM_CASES)
def test_int4_gemm_matches_reference(gemm: ModuleType, m: int, n: int, k: int, group: int, split_k: int,
                                     block_k: int, x_dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k)
    packed, scale, dequant = random_int4_weight(n, k, group, scale_dtype, gen)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    out = gemm.w4a16_gemm(x.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE), group, split_k=split_k,
                          block_k=block_k)
    assert out.shape == (m, n) and out.dtype == x_dtype
    assert rel_error(out, x.double() @ dequant.T) < tolerance(x_dtype)


# (M, N, K, block (bn, bk), split_k, block_m, block_k, x dtype): N and K off the blocks (partial last blocks) in
# the release's 128 x 128 blocks and in small ones, where a tile spans several row blocks; block_k = bk, and below
# it (several K tiles per scale column); bn not a power of two; M = 1, a few, and above BLOCK_M.
FP8_GEMM_CASES = [
    (1, 136, 200, (128, 128), 1, None, 64, torch.float32),
    (1, 136, 200, (128, 128), 4, None, 64, torch.bfloat16),                           # one split per K tile
    (5, 72, 100, (16, 32), 2, None, 32, torch.float32),
    (5, 72, 100, (16, 32), 1, None, 16, torch.bfloat16),
    (40, 50, 96, (32, 32), 3, 16, 32, torch.float32),                                 # 3 row tiles of 16
    (3, 40, 150, (24, 48), 2, None, 16, torch.float16),
]


@runs_kernels
@pytest.mark.parametrize("m,n,k,block,split_k,block_m,block_k,x_dtype", FP8_GEMM_CASES)
def test_fp8_gemm_matches_reference(gemm: ModuleType, m: int, n: int, k: int, block: tuple[int, int], split_k: int,
                                    block_m: int | None, block_k: int, x_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k + block[0])
    codes, scale, dequant = random_fp8_weight(n, k, block, gen)
    # NaN past K, which a read past K would spread (on GPU: the interpreter reads the NaN code as 480)
    codes, scale = in_nan_rows(codes.to(DEVICE), 16), in_nan_rows(scale.to(DEVICE), 1)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    out = gemm.fp8_gemm(x.to(DEVICE), codes, scale, block, split_k=split_k, block_m=block_m,
                        block_k=block_k)
    assert out.shape == (m, n) and out.dtype == x_dtype
    assert rel_error(out, x.double() @ dequant.T) < tolerance(x_dtype)


@runs_kernels
@pytest.mark.parametrize("weight_format", ["int4", "fp8"])
def test_gemm_default_split_k_and_strided_rows(gemm: ModuleType, weight_format: str) -> None:
    gen = torch.Generator().manual_seed(1)
    args, dequant = random_weight(weight_format, 64, 128, gen)
    x = torch.randn(3, 2, 128, generator=gen)[:, 0]                                    # rows 256 apart
    run = gemm.w4a16_gemm if weight_format == "int4" else gemm.fp8_gemm
    out = run(x.to(DEVICE), *(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
    assert rel_error(out, x.double() @ dequant.T) < FP32_TOLERANCE


def test_default_split_k(gemm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gemm._default_split_k(torch.device("cpu"), 1, 100) == 1
    monkeypatch.setattr(importlib.import_module("nano.kernels.common"), "_sm_count", lambda index: 132)  # an H200
    cuda = torch.device("cuda", 0)
    assert gemm._default_split_k(cuda, 32, 112) == 9                                   # 288 programs >= 2 x 132
    assert gemm._default_split_k(cuda, 32, 4) == 4                                     # one split per K tile
    assert gemm._default_split_k(cuda, 512, 112) == 1                                  # enough tiles already


def test_fp8_needs_compute_capability_8_9(gemm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))   # Hopper
    gemm.check_fp8_device(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))   # Ampere
    with pytest.raises(ValueError, match="compute capability >= 8.9 .* got 8.0"):
        gemm.check_fp8_device(cuda)
    gemm.check_fp8_device(torch.device("cpu"))                                         # the interpreter has it


def test_empty_inputs(gemm: ModuleType, moe: ModuleType) -> None:
    out = gemm.w4a16_gemm(torch.randn(0, 64), torch.zeros(16, 8, dtype=torch.int32), torch.ones(16, 2), 32)
    assert out.shape == (0, 16)
    out = gemm.fp8_gemm(torch.randn(2, 0), torch.zeros(16, 0, dtype=torch.float8_e4m3fn), torch.ones(1, 0))
    assert out.shape == (2, 16) and not out.any()
    e, h, inter = 4, 64, 32
    out = moe.fused_moe(torch.randn(0, h), torch.zeros(e, 2 * inter, h // 8, dtype=torch.int32),
                        torch.ones(e, 2 * inter, h // 32), torch.zeros(e, h, inter // 8, dtype=torch.int32),
                        torch.ones(e, h, inter // 32), torch.zeros(0, 2, dtype=torch.int32), torch.ones(0, 2),
                        weight_format="int4", group_size=32)
    assert out.shape == (0, h)
    fp8 = torch.float8_e4m3fn
    out = moe.fused_moe(torch.randn(0, h), torch.zeros(e, 2 * inter, h, dtype=fp8), torch.ones(e, 2, 2),
                        torch.zeros(e, h, inter, dtype=fp8), torch.ones(e, 2, 1), torch.zeros(0, 2, dtype=torch.int32),
                        torch.ones(0, 2), weight_format="fp8", fp8_block=(32, 32), block_k=32)
    assert out.shape == (0, h)


# --- fused MoE ---

def route(tokens: int, experts: int, top_k: int, used: int, gen: torch.Generator) -> torch.Tensor:
    """topk_ids [T, top_k]: distinct experts per token, drawn from the first `used` experts only."""
    return torch.stack([torch.randperm(used, generator=gen)[:top_k] for _ in range(tokens)])


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """Per-token loop in float64 over dequantized experts w13 [E, 2I, H], w2 [E, H, I] -> [T, H]."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, r in zip(topk_ids[t].tolist(), topk_weights[t].double()):
            gate_up = w13[e] @ x[t].double()
            out[t] += r * (w2[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


def int4_experts(e: int, hidden: int, inter: int, group: int, gen: torch.Generator
                 ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """([w13 packed, w13 scale, w2 packed, w2 scale] with bf16 scales, w13 [E, 2I, H] and w2 [E, H, I] in fp64)."""
    w13 = [random_int4_weight(2 * inter, hidden, group, torch.bfloat16, gen) for _ in range(e)]
    w2 = [random_int4_weight(hidden, inter, group, torch.bfloat16, gen) for _ in range(e)]
    (w13_packed, w13_scale, w13_ref), (w2_packed, w2_scale, w2_ref) = (map(torch.stack, zip(*w)) for w in (w13, w2))
    return [w13_packed, w13_scale, w2_packed, w2_scale], w13_ref, w2_ref


def fp8_experts(e: int, hidden: int, inter: int, block: tuple[int, int], gen: torch.Generator
                ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """As int4_experts for FP8: gate and up quantized separately, as a checkpoint stores them, then their codes and
    their scales concatenated (whole blocks, since I is a multiple of bn)."""
    w13, w13_scale, w13_ref, w2, w2_scale, w2_ref = ([] for _ in range(6))
    for _ in range(e):
        (gate, gate_scale, gate_ref), (up, up_scale, up_ref) = (random_fp8_weight(inter, hidden, block, gen)
                                                                for _ in range(2))
        w13.append(torch.cat([gate, up]))
        w13_scale.append(torch.cat([gate_scale, up_scale]))
        w13_ref.append(torch.cat([gate_ref, up_ref]))
        down, down_scale, down_ref = random_fp8_weight(hidden, inter, block, gen)
        w2.append(down)
        w2_scale.append(down_scale)
        w2_ref.append(down_ref)
    stacked = [torch.stack(t) for t in (w13, w13_scale, w2, w2_scale)]
    return stacked, torch.stack(w13_ref), torch.stack(w2_ref)


# (T, E, top_k, experts used, H, I, format, group size or FP8 block, block_k, x dtype): experts past `used` get no
# route; FP8 H off the blocks (partial blocks in w13's columns and w2's rows).
MOE_CASES = [
    (1, 8, 2, 8, 128, 64, "int4", 32, 64, torch.float32),
    (7, 8, 3, 6, 64, 128, "int4", 64, 64, torch.float32),
    (64, 8, 2, 6, 128, 128, "int4", 128, 64, torch.float32),
    (20, 8, 3, 8, 64, 64, "int4", 32, 64, torch.bfloat16),
    (1, 4, 2, 4, 200, 128, "fp8", (128, 128), 64, torch.float32),
    (9, 8, 3, 5, 72, 32, "fp8", (16, 32), 16, torch.bfloat16),
    (40, 8, 2, 6, 100, 64, "fp8", (32, 32), 32, torch.float32),                        # > BLOCK_M routes / expert
]


@runs_kernels
@pytest.mark.parametrize("tokens,experts,top_k,used,hidden,inter,weight_format,blocks,block_k,x_dtype", MOE_CASES)
def test_fused_moe_matches_reference(moe: ModuleType, tokens: int, experts: int, top_k: int, used: int,
                                     hidden: int, inter: int, weight_format: str, blocks: int | tuple[int, int],
                                     block_k: int, x_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(tokens * 100 + top_k)
    if weight_format == "int4":
        weights, w13, w2 = int4_experts(experts, hidden, inter, blocks, gen)
        options = dict(group_size=blocks)
    else:
        weights, w13, w2 = fp8_experts(experts, hidden, inter, blocks, gen)
        options = dict(fp8_block=blocks)
    x = torch.randn(tokens, hidden, generator=gen).to(x_dtype)
    topk_ids = route(tokens, experts, top_k, used, gen)
    topk_weights = torch.rand(tokens, top_k, generator=gen)
    args = [t.to(DEVICE) for t in (x, *weights, topk_ids, topk_weights)]
    out = moe.fused_moe(*args, weight_format=weight_format, block_k=block_k, **options)
    assert out.shape == (tokens, hidden) and out.dtype == x_dtype
    # 16-bit: the intermediates [gate | up] and h are rounded to x's dtype too
    assert rel_error(out, moe_reference(x, w13, w2, topk_ids, topk_weights)) < tolerance(x_dtype, roundings=2)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="compared under the interpreter, on CPU")
def test_quantized_experts_through_the_fused_moe_in_the_engine_match_the_torch_path(moe: ModuleType, tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    """Native INT4 and FP8 checkpoints keep their experts quantized; the fused MoE kernel (one kernel for both
    formats) gives the same ids as the torch path — also with BF16 prefill weights beside INT4 decode weights,
    where decode steps still take the fused kernel. (Dense layers take their Triton GEMMs on CUDA only: the tests
    above and benchmarks/gpu.py check those.)"""
    from fixtures import build_tokenizer_dir, convert_to_fp8_block, convert_to_int4_ct, make_checkpoint
    from nano import LLM, SamplingParams
    from nano.model import MoE

    src = make_checkpoint(tmp_path / "src", "deepseek_v3", qk_rope_head_dim=16)
    build_tokenizer_dir(src)
    convert_to_int4_ct(src, tmp_path / "int4")
    convert_to_fp8_block(src, tmp_path / "fp8", block=(32, 32))   # expert width 32: whole blocks, the kernel runs
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fused_calls: list[tuple[str, int]] = []
    fused_moe = moe.fused_moe
    monkeypatch.setattr(moe, "fused_moe", lambda x, **kw: fused_calls.append((kw["weight_format"], x.shape[0]))
                        or fused_moe(x, **kw))
    outs = {}
    for checkpoint, formats in (("int4", {}), ("int4", {"prefill_weights": "bf16", "decode_weights": "int4"}),
                                ("fp8", {})):
        for kernel_choice in ("torch", "triton"):
            fused_calls.clear()
            llm = LLM(str(tmp_path / checkpoint), kv_budget="4MiB", page_size=16, decode_kernel=kernel_choice,
                      progress=False, **formats)
            assert llm.engine.use_kernels == (kernel_choice == "triton")
            moes = [m for m in llm.model.modules() if isinstance(m, MoE)]
            assert all(m.packed_experts(True) is not None for m in moes)
            assert all((m.packed_experts(False) is None) == bool(formats) for m in moes)   # BF16 prefill: not packed
            ids = [o.token_ids for o in llm.generate([[5, 6, 7] * 9, [1] * 20], params)]
            outs[(checkpoint, bool(formats), kernel_choice)] = (ids, list(fused_calls))
    for case in (("int4", False), ("int4", True), ("fp8", False)):
        (torch_ids, torch_calls), (triton_ids, triton_calls) = outs[(*case, "torch")], outs[(*case, "triton")]
        assert torch_ids == triton_ids and torch_calls == [] and {fmt for fmt, _ in triton_calls} == {case[0]}
    # rows per fused call: INT4 everywhere sends the prefills through it too (27 + 20 prompt rows); with BF16
    # prefill only decode passes do, one row per decoding sequence
    assert max(rows for _, rows in outs["int4", False, "triton"][1]) > 2
    assert max(rows for _, rows in outs["int4", True, "triton"][1]) <= 2


@pytest.mark.parametrize("tokens,top_k,used,block_m", [(1, 2, 8, 16), (7, 3, 6, 4), (64, 2, 6, 16), (50, 6, 7, 32)])
def test_moe_align_block_size(moe: ModuleType, tokens: int, top_k: int, used: int, block_m: int) -> None:
    experts = 8
    gen = torch.Generator().manual_seed(tokens)
    topk_ids = route(tokens, experts, top_k, used, gen)
    sorted_ids, expert_ids, total = moe.moe_align_block_size(topk_ids, experts, block_m)
    routes = tokens * top_k
    counts = torch.bincount(topk_ids.flatten(), minlength=experts)
    assert total == sum(math.ceil(c / block_m) * block_m for c in counts.tolist())
    assert sorted_ids.dtype == expert_ids.dtype == torch.int32
    assert sorted_ids.shape == (total,) and expert_ids.shape == (total // block_m,)
    real = sorted_ids[sorted_ids != routes]
    assert sorted(real.tolist()) == list(range(routes))                               # each route exactly once
    assert ((sorted_ids >= 0) & (sorted_ids <= routes)).all()                          # the rest is the sentinel
    flat = topk_ids.flatten()
    for b, e in enumerate(expert_ids.tolist()):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        block = block[block != routes]
        assert block.numel() > 0 and (flat[block.long()] == e).all()                  # one expert per block
    assert set(expert_ids.tolist()) == set(flat.tolist())                             # unused experts: no block


# --- malformed inputs: one ValueError line each ---

def expect_errors(run, good: dict, bad: list[tuple[dict, str]]) -> None:
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            run(**{**good, **change})


def test_int4_gemm_malformed_inputs(gemm: ModuleType) -> None:
    x, packed, scale = torch.randn(3, 200), torch.zeros(64, 25, dtype=torch.int32), torch.ones(64, 7)
    expect_errors(gemm.w4a16_gemm, dict(x=x, weight_packed=packed, weight_scale=scale, group_size=32), [
        (dict(x=x[0]), "x must be a 2-D"),
        (dict(x=x.double()), "x must be a 2-D"),
        (dict(x=torch.randn(3, 208)), "weight_packed must be int32 \\[64, 26\\]"),     # K mismatch
        (dict(group_size=64), "weight_scale must be \\[64, 4\\]"),
        (dict(weight_packed=packed.long()), "weight_packed must be int32"),
        (dict(weight_packed=packed.view(-1)), "weight_packed must be int32 \\[N"),
        (dict(weight_scale=torch.ones(63, 7)), "weight_scale must be"),
        (dict(weight_scale=scale.int()), "weight_scale must be"),
        (dict(group_size=20), "multiple of 8"),
        (dict(group_size=0), "multiple of 8"),
        (dict(x=torch.randn(200, 3).T), "contiguous"),
        (dict(weight_scale=torch.ones(7, 64).T), "contiguous"),
        (dict(split_k=0), "split_k"),
        (dict(block_k=8), "block_k=8"),
        (dict(block_m=48), "block_m=48"),
    ])


def test_fp8_gemm_malformed_inputs(gemm: ModuleType) -> None:
    x, weight, scale = torch.randn(3, 200), torch.zeros(136, 200, dtype=torch.float8_e4m3fn), torch.ones(2, 2)
    expect_errors(gemm.fp8_gemm, dict(x=x, weight=weight, weight_scale_inv=scale), [
        (dict(x=x.half()[0]), "x must be a 2-D"),
        (dict(x=torch.randn(3, 264)), "weight must be float8_e4m3fn \\[136, 264\\]"),  # K mismatch
        (dict(weight=weight.view(torch.uint8)), "weight must be float8_e4m3fn \\[136, 200\\]"),
        (dict(weight=weight.view(-1)), "weight must be float8_e4m3fn \\[N, K\\]"),
        (dict(weight_scale_inv=torch.ones(2, 1)), "weight_scale_inv must be \\[2, 2\\] in float32"),
        (dict(weight_scale_inv=scale.bfloat16()), "weight_scale_inv must be \\[2, 2\\] in float32"),
        (dict(block_size=(64, 128)), "weight_scale_inv must be \\[3, 2\\]"),
        (dict(weight_scale_inv=torch.ones(2, 2).T), "contiguous"),
        (dict(block_size=(128, 96)), "block_k=64 must divide .* bk=96"),
        (dict(block_k=256), "block_k=256 must divide"),
        (dict(block_size=(0, 128)), "two positive ints"),
        (dict(block_size=(128.0, 128)), "two positive ints"),
        (dict(block_k=24, block_size=(128, 48), weight_scale_inv=torch.ones(2, 5)), "block_k=24"),  # not a power of 2
        (dict(split_k=0), "split_k"),
    ])


def test_moe_malformed_inputs(moe: ModuleType) -> None:
    e, t, h, inter, g = 4, 3, 64, 32, 32
    routing = dict(topk_ids=torch.zeros(t, 2, dtype=torch.int32), topk_weights=torch.ones(t, 2))
    int4 = dict(x=torch.randn(t, h), w13=torch.zeros(e, 2 * inter, h // 8, dtype=torch.int32),
                w13_scale=torch.ones(e, 2 * inter, h // g), w2=torch.zeros(e, h, inter // 8, dtype=torch.int32),
                w2_scale=torch.ones(e, h, inter // g), weight_format="int4", group_size=g, **routing)
    expect_errors(moe.fused_moe, int4, [
        (dict(x=torch.randn(t, h + 8)), "w13 must be int32"),
        (dict(w13=torch.zeros(e, 2 * inter + 1, h // 8, dtype=torch.int32)), "expected w13 \\[E, 2I, ceil"),
        (dict(w13=torch.zeros(2 * inter, h // 8, dtype=torch.int32)), "expected w13"),
        (dict(w13_scale=torch.ones(e, 2 * inter, h // 16)), "w13_scale must be"),
        (dict(w2=torch.zeros(e + 1, h, inter // 8, dtype=torch.int32)), "w2 must be int32"),
        (dict(w2_scale=torch.ones(e, h, 2)), "w2_scale must be"),
        (dict(topk_ids=torch.zeros(t + 1, 2, dtype=torch.int32)), "topk_ids must be"),
        (dict(topk_ids=torch.zeros(t, 2)), "topk_ids must be"),
        (dict(topk_weights=torch.ones(t, 2).double()), "topk_weights must be fp32"),
        (dict(topk_weights=torch.ones(t, 3)), "topk_weights must be fp32"),
        (dict(topk_ids=torch.full((t, 2), e, dtype=torch.int32)), "only 4 experts"),
        (dict(group_size=12), "multiple of 8"),
        (dict(group_size=None), "needs group_size"),
        (dict(weight_format="int8"), "weight_format must be one of"),
        (dict(block_n=48), "block_n=48"),
    ])
    fp8 = torch.float8_e4m3fn
    fp8_good = dict(x=torch.randn(t, h), w13=torch.zeros(e, 2 * inter, h, dtype=fp8), w13_scale=torch.ones(e, 2, 2),
                    w2=torch.zeros(e, h, inter, dtype=fp8), w2_scale=torch.ones(e, 2, 1), weight_format="fp8",
                    fp8_block=(32, 32), block_k=32, **routing)
    expect_errors(moe.fused_moe, fp8_good, [
        (dict(w13=torch.zeros(2 * inter, h, dtype=fp8)), "expected w13 \\[E, 2I, H\\] and w2 \\[E, H, I\\]"),
        (dict(w13=torch.zeros(e, 2 * inter, h, dtype=torch.bfloat16)), "w13 must be float8_e4m3fn"),
        (dict(w13_scale=torch.ones(e, 2, 2).half()), "w13_scale must be \\[4, 2, 2\\] in float32"),
        (dict(w2_scale=torch.ones(e, 2, 2)), "w2_scale must be \\[4, 2, 1\\]"),
        (dict(fp8_block=(64, 32), w13_scale=torch.ones(e, 1, 2), w2_scale=torch.ones(e, 1, 1)),
         "I=32 must be a multiple of .* bn=64"),
        (dict(block_k=64), "block_k=64 must divide"),
        (dict(group_size=32), "group_size=32 is for weight_format='int4' only"),
        (dict(weight_format="FP8"), "weight_format must be one of"),
    ])
