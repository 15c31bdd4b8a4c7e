"""The W4A16 GEMM and fused-MoE Triton kernels against dequantize-then-matmul references in float64.

Weights are packed here, by a packer independent of nano, in the compressed-tensors `pack-quantized` layout;
its padding nibbles hold 0 (value -8, not the 8 = value 0 that checkpoints store), so a kernel that read past K
would show. Without CUDA the kernels run in Triton's interpreter, in a child process, as in test_kernels.py
(TRITON_INTERPRET must be set before triton is first imported). Shapes stay small: the interpreter takes
milliseconds per tile step.
"""
from __future__ import annotations

import importlib
import math
from types import ModuleType

import pytest
import torch
from fixtures import KERNELS_HERE, rerun_under_interpreter, runs_kernels
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative error bounds. fp32 activations: 1e-3. 16-bit ones: their products and the results are 16-bit on
# GPU; the interpreter computes in fp32 and rounds each stored result once (truncating): one ulp.
ULP = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
GPU_16BIT_TOLERANCE = 3e-2


@pytest.fixture(scope="module")
def gemm() -> ModuleType:
    pytest.importorskip("triton", reason="triton is not installed")
    return importlib.import_module("nano.kernels.int4_gemm")


@pytest.fixture(scope="module")
def moe() -> ModuleType:
    pytest.importorskip("triton", reason="triton is not installed")
    return importlib.import_module("nano.kernels.int4_moe")


@pytest.mark.skipif(KERNELS_HERE, reason="the kernel tests run in this process")
def test_under_interpreter() -> None:
    rerun_under_interpreter(__file__)


def pack(q: torch.Tensor) -> torch.Tensor:
    """q int [N, K] in -8..7 -> int32 [N, ceil(K/8)]: element k as q + 8 in bits 4*(k % 8) of word k // 8."""
    n, k = q.shape
    nibbles = torch.zeros(n, math.ceil(k / 8) * 8, dtype=torch.int64)                  # padding nibbles: 0
    nibbles[:, :k] = q + 8
    words = torch.zeros(n, nibbles.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        words += nibbles[:, j::8] << (4 * j)                                           # [N, K/8] in [0, 2^32)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def random_weight(n: int, k: int, group: int, scale_dtype: torch.dtype, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random INT4 weight [N, K] -> (packed int32 [N, ceil(K/8)], scale [N, ceil(K/G)], dequantized fp64)."""
    q = torch.randint(-8, 8, (n, k), generator=gen)
    scale = (torch.rand(n, math.ceil(k / group), generator=gen) * 0.1 + 0.01).to(scale_dtype)
    dequant = q.double() * scale.double().repeat_interleave(group, dim=1)[:, :k]
    return pack(q), scale, dequant


def random_experts(e: int, n: int, k: int, group: int, gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E stacked weights [E, N, K]: (packed [E, N, ceil(K/8)], scale [E, N, ceil(K/G)] bf16, dequantized fp64)."""
    packed, scale, dequant = zip(*(random_weight(n, k, group, torch.bfloat16, gen) for _ in range(e)))
    return torch.stack(packed), torch.stack(scale), torch.stack(dequant)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.cpu().double() - ref).abs().max() / ref.abs().max()).item()


def test_packer_agrees_with_nano_reference_dequant() -> None:
    from nano.quant import unpack_int4
    gen = torch.Generator().manual_seed(0)
    for k in (64, 203):
        packed, scale, dequant = random_weight(5, k, 32, torch.float32, gen)
        torch.testing.assert_close(unpack_int4(packed, scale, (5, k), 32), dequant.float(), rtol=0, atol=0)


# (M, N, K, group size, split_k, block_k, x dtype, scale dtype): N, K off the 64 blocks; K = 200 is ragged in
# groups, 203 also in words; block_k above, at and below the group size.
GEMM_CASES = [
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
@pytest.mark.parametrize("m,n,k,group,split_k,block_k,x_dtype,scale_dtype", GEMM_CASES)
def test_gemm_matches_reference(gemm: ModuleType, m: int, n: int, k: int, group: int, split_k: int, block_k: int,
                                x_dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k)
    packed, scale, dequant = random_weight(n, k, group, scale_dtype, gen)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    out = gemm.w4a16_gemm(x.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE), group, split_k=split_k,
                          block_k=block_k)
    assert out.shape == (m, n) and out.dtype == x_dtype
    tol = 1e-3 if x_dtype == torch.float32 else ULP[x_dtype] if DEVICE == "cpu" else GPU_16BIT_TOLERANCE
    assert rel_error(out, x.double() @ dequant.T) < tol


@runs_kernels
def test_gemm_default_split_k_and_strided_rows(gemm: ModuleType) -> None:
    gen = torch.Generator().manual_seed(1)
    packed, scale, dequant = random_weight(64, 128, 32, torch.bfloat16, gen)
    x = torch.randn(3, 2, 128, generator=gen)[:, 0]                                    # rows 256 apart
    out = gemm.w4a16_gemm(x.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE), 32)
    assert rel_error(out, x.double() @ dequant.T) < 1e-3


def test_default_split_k(gemm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gemm._default_split_k(torch.device("cpu"), 1, 100) == 1
    monkeypatch.setattr(importlib.import_module("nano.kernels.common"), "_sm_count", lambda index: 132)  # an H200
    cuda = torch.device("cuda", 0)
    assert gemm._default_split_k(cuda, 32, 112) == 9                                   # 288 programs >= 2 x 132
    assert gemm._default_split_k(cuda, 32, 4) == 4                                     # one split per K tile
    assert gemm._default_split_k(cuda, 512, 112) == 1                                  # enough tiles already


def test_empty_inputs(gemm: ModuleType, moe: ModuleType) -> None:
    out = gemm.w4a16_gemm(torch.randn(0, 64), torch.zeros(16, 8, dtype=torch.int32), torch.ones(16, 2), 32)
    assert out.shape == (0, 16)
    e, h, inter = 4, 64, 32
    out = moe.fused_moe_w4a16(torch.randn(0, h), torch.zeros(e, 2 * inter, h // 8, dtype=torch.int32),
                              torch.ones(e, 2 * inter, h // 32), torch.zeros(e, h, inter // 8, dtype=torch.int32),
                              torch.ones(e, h, inter // 32), torch.zeros(0, 2, dtype=torch.int32),
                              torch.ones(0, 2), 32)
    assert out.shape == (0, h)


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


# (T, E, top_k, experts used, H, I, group size, x dtype)
MOE_CASES = [
    (1, 8, 2, 8, 128, 64, 32, torch.float32),
    (7, 8, 3, 6, 64, 128, 64, torch.float32),
    (64, 8, 2, 6, 128, 128, 128, torch.float32),
    (20, 8, 3, 8, 64, 64, 32, torch.bfloat16),
]


@runs_kernels
@pytest.mark.parametrize("tokens,experts,top_k,used,hidden,inter,group,x_dtype", MOE_CASES)
def test_fused_moe_matches_reference(moe: ModuleType, tokens: int, experts: int, top_k: int, used: int,
                                     hidden: int, inter: int, group: int, x_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(tokens * 100 + top_k)
    w13_packed, w13_scale, w13 = random_experts(experts, 2 * inter, hidden, group, gen)
    w2_packed, w2_scale, w2 = random_experts(experts, hidden, inter, group, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(x_dtype)
    topk_ids = route(tokens, experts, top_k, used, gen)
    topk_weights = torch.rand(tokens, top_k, generator=gen)
    args = [t.to(DEVICE) for t in (x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights)]
    out = moe.fused_moe_w4a16(*args, group)
    assert out.shape == (tokens, hidden) and out.dtype == x_dtype
    # 16-bit: the intermediates [gate | up] and h are rounded to x's dtype too
    tol = 1e-3 if x_dtype == torch.float32 else 2 * ULP[x_dtype] if DEVICE == "cpu" else GPU_16BIT_TOLERANCE
    assert rel_error(out, moe_reference(x, w13, w2, topk_ids, topk_weights)) < tol


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


def test_gemm_malformed_inputs(gemm: ModuleType) -> None:
    x, packed, scale = torch.randn(3, 200), torch.zeros(64, 25, dtype=torch.int32), torch.ones(64, 7)
    good = dict(x=x, weight_packed=packed, weight_scale=scale, group_size=32)
    bad = [
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
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            gemm.w4a16_gemm(**{**good, **change})


def test_moe_malformed_inputs(moe: ModuleType) -> None:
    e, t, h, inter, g = 4, 3, 64, 32, 32
    good = dict(x=torch.randn(t, h), w13_packed=torch.zeros(e, 2 * inter, h // 8, dtype=torch.int32),
                w13_scale=torch.ones(e, 2 * inter, h // g), w2_packed=torch.zeros(e, h, inter // 8, dtype=torch.int32),
                w2_scale=torch.ones(e, h, inter // g), topk_ids=torch.zeros(t, 2, dtype=torch.int32),
                topk_weights=torch.ones(t, 2), group_size=g)
    bad = [
        (dict(x=torch.randn(t, h + 8)), "w13_packed must be int32"),
        (dict(w13_packed=torch.zeros(e, 2 * inter + 1, h // 8, dtype=torch.int32)), "expected w13_packed"),
        (dict(w13_packed=torch.zeros(2 * inter, h // 8, dtype=torch.int32)), "expected w13_packed"),
        (dict(w13_scale=torch.ones(e, 2 * inter, h // 16)), "w13_scale must be"),
        (dict(w2_packed=torch.zeros(e + 1, h, inter // 8, dtype=torch.int32)), "w2_packed must be int32"),
        (dict(w2_scale=torch.ones(e, h, 2)), "w2_scale must be"),
        (dict(topk_ids=torch.zeros(t + 1, 2, dtype=torch.int32)), "topk_ids must be"),
        (dict(topk_ids=torch.zeros(t, 2)), "topk_ids must be"),
        (dict(topk_weights=torch.ones(t, 2).double()), "topk_weights must be fp32"),
        (dict(topk_weights=torch.ones(t, 3)), "topk_weights must be fp32"),
        (dict(topk_ids=torch.full((t, 2), e, dtype=torch.int32)), "only 4 experts"),
        (dict(group_size=12), "multiple of 8"),
        (dict(block_n=48), "block_n=48"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            moe.fused_moe_w4a16(**{**good, **change})
