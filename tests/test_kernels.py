"""The paged MLA decode kernel against a float64 reference (dense softmax over gathered pages), and in the engine
against the torch path.

Without CUDA the kernel runs in Triton's interpreter, which must be chosen before triton is first imported:
@triton.jit reads TRITON_INTERPRET when it decorates a function, and triton's own helpers (tl.cdiv, tl.max,
tl.sum) are decorated when triton.language is imported. Setting it here could come too late (another test
module may have imported triton) and would leak into the rest of the suite, so on a CPU-only run without the
variable, test_under_interpreter reruns this file in a child process with TRITON_INTERPRET=1. Shapes stay
small: the interpreter takes milliseconds per tile step.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from types import ModuleType

import pytest
import torch
from fixtures import KERNELS_HERE, rerun_under_interpreter, runs_kernels

from nano.kv import KVPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_MAX = 448.0


@pytest.fixture(scope="module")
def mla() -> ModuleType:
    pytest.importorskip("triton", reason="triton is not installed")
    return importlib.import_module("nano.kernels.mla_decode")


@pytest.mark.skipif(KERNELS_HERE, reason="the kernel tests run in this process")
def test_under_interpreter() -> None:
    rerun_under_interpreter(__file__)


def make_cache(lens: list[int], page_size: int, c: int, r: int, dtype: torch.dtype, gen: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A pool with every sequence's pages at shuffled ids; unused pages and slots hold NaN, table padding is -1.
    Returns (kv_pages [P, page_size, C + R], kv_scale [P, page_size] or None, dequantized pool fp64, page_table)."""
    pages_per_seq = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_seq) + 3                                                 # a few never used
    ids = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens), max(pages_per_seq) + 1), -1, dtype=torch.int32)
    used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    offset = 0
    for b, (n, count) in enumerate(zip(lens, pages_per_seq)):
        table[b, :count] = ids[offset:offset + count].int()
        offset += count
        tokens = torch.arange(n)
        used[table[b, tokens // page_size].long(), tokens % page_size] = True

    values = torch.randn(num_pages, page_size, c + r, generator=gen, dtype=torch.float64)
    values[..., :c] *= 2.0                                                             # latent and rope differ
    values[~used] = float("nan")
    if dtype == torch.float8_e4m3fn:
        scale = values.abs().amax(-1) / FP8_MAX                                        # [P, page_size]
        kv = (values / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(dtype)
        scale = scale.float()
        dequant = kv.double() * scale.double()[..., None]
    else:
        kv, scale = values.to(dtype), None
        dequant = kv.double()
    return kv, scale, dequant, table


def reference(q_abs: torch.Tensor, q_pe: torch.Tensor, dequant: torch.Tensor, table: torch.Tensor,
              lens: list[int], softmax_scale: float) -> torch.Tensor:
    """Gather each sequence's tokens through its page table and run dense attention in float64 -> [B, H, C]."""
    c, page_size = q_abs.shape[-1], dequant.shape[1]
    outs = []
    for b, n in enumerate(lens):
        tokens = torch.arange(n)
        rows = dequant[table[b, tokens // page_size].long(), tokens % page_size]       # [n, C + R]
        scores = (q_abs[b].double() @ rows[:, :c].T + q_pe[b].double() @ rows[:, c:].T) * softmax_scale
        outs.append(scores.softmax(-1) @ rows[:, :c])                                  # [H, C]
    return torch.stack(outs)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


# (page dtype, query dtype, page size, heads, C, R, sequence lengths, num_splits, interpreter tolerance).
# A bf16 output is off by up to one bf16 ulp (2^-7 relative): the interpreter's fp32 -> bf16 cast truncates.
CASES = [
    (torch.float32, torch.float32, 16, 20, 64, 16, [1, 37, 16, 150], 1, 1e-4),
    (torch.float32, torch.float32, 64, 16, 128, 32, [64, 1, 129], 1, 1e-4),
    (torch.float32, torch.float32, 32, 5, 64, 16, [200, 33, 1, 95, 32], 3, 1e-4),
    (torch.bfloat16, torch.float32, 16, 12, 64, 32, [7, 100, 1], 1, 1e-3),
    (torch.bfloat16, torch.bfloat16, 32, 16, 64, 16, [45, 3], 2, 2**-7),
    (torch.float16, torch.float32, 128, 16, 64, 16, [130, 2], 2, 1e-3),
    (torch.float8_e4m3fn, torch.float32, 64, 20, 128, 32, [1, 150, 65], 1, 1e-3),
    (torch.float8_e4m3fn, torch.bfloat16, 16, 16, 64, 16, [90, 17], 4, 2**-7),
]


@runs_kernels
@pytest.mark.parametrize("kv_dtype,q_dtype,page_size,heads,c,r,lens,splits,tol", CASES)
def test_matches_reference(mla: ModuleType, kv_dtype: torch.dtype, q_dtype: torch.dtype, page_size: int,
                           heads: int, c: int, r: int, lens: list[int], splits: int, tol: float) -> None:
    gen = torch.Generator().manual_seed(page_size * 1000 + heads)
    kv, scale, dequant, table = make_cache(lens, page_size, c, r, kv_dtype, gen)
    q = torch.randn(len(lens), heads, c + r, generator=gen).to(q_dtype)
    q_abs, q_pe = q[..., :c], q[..., c:]                                               # strided views
    softmax_scale = (c + r) ** -0.5
    out = mla.mla_decode_paged(q_abs.to(DEVICE), q_pe.to(DEVICE), kv.to(DEVICE),
                               None if scale is None else scale.to(DEVICE), table.to(DEVICE),
                               torch.tensor(lens, dtype=torch.int32, device=DEVICE), softmax_scale,
                               num_splits=splits)
    assert out.shape == (len(lens), heads, c) and out.dtype == q_dtype
    if DEVICE == "cuda" and kv_dtype != torch.float32:
        tol = 2e-2                                                                     # bf16/fp16 products
    assert rel_error(out.cpu(), reference(q_abs, q_pe, dequant, table, lens, softmax_scale)) < tol


@runs_kernels
def test_default_splits_and_availability(mla: ModuleType) -> None:
    from nano.kernels import triton_available
    assert triton_available() and (DEVICE == "cuda" or importlib.import_module("nano.kernels.common").INTERPRETED)
    gen = torch.Generator().manual_seed(0)
    kv, _, dequant, table = make_cache([40], 16, 64, 16, torch.float32, gen)
    q_abs, q_pe = torch.randn(1, 16, 64, generator=gen), torch.randn(1, 16, 16, generator=gen)
    out = mla.mla_decode_paged(q_abs.to(DEVICE), q_pe.to(DEVICE), kv.to(DEVICE), None, table.to(DEVICE),
                               torch.tensor([40], dtype=torch.int32, device=DEVICE), 0.125)
    assert rel_error(out.cpu(), reference(q_abs, q_pe, dequant, table, [40], 0.125)) < 1e-4


def true_rows(pool: KVPool) -> torch.Tensor:
    """Layer 0 of a pool as the float64 values its parts stand for, by each layout's definition (nano/kv.py)
    -> [P, page_size, C + R]."""
    data = {name: pool.data[name][0].cpu().double() for name in ("kv", "kv_scale", "rope") if name in pool.data}
    if "rope" in data:                     # FP8 tile: latent codes times their tile's scale | BF16 rope key
        tiles = data["kv_scale"].shape[-1]
        latent = data["kv"].unflatten(-1, (tiles, -1)) * data["kv_scale"][..., None]
        return torch.cat([latent.flatten(-2), data["rope"]], -1)
    if "kv_scale" in data:                 # FP8 token: codes times the token's scale
        return data["kv"] * data["kv_scale"][..., None]
    return data["kv"]                      # plain, and FP8 tensor (the code is the value)


# (KV dtype, FP8 layout, C, R, page size, heads, sequence lengths, num_splits). The tile layout scales the latent in
# nano.config.TILES = 4 tiles (FlashMLA's 128 values of a 512-value latent; 32 values here, at C = 128).
POOL_CASES = [
    ("bf16", "token", 64, 16, 16, 16, [1, 37, 70], 1),
    ("fp8", "token", 64, 16, 16, 20, [70, 1, 37], 2),
    ("fp8", "tensor", 64, 32, 32, 16, [33, 1, 90], 1),
    ("fp8", "tile", 128, 32, 16, 16, [50, 17, 1], 2),
]


@runs_kernels
@pytest.mark.parametrize("kv_dtype,layout,c,r,page_size,heads,lens,splits", POOL_CASES)
def test_each_pool_layout_matches_the_torch_path_and_a_float64_reference(
        mla: ModuleType, kv_dtype: str, layout: str, c: int, r: int, page_size: int, heads: int, lens: list[int],
        splits: int) -> None:
    """Pages written through KVPool.write, read in place by the kernel as the engine passes them (the layer's
    `pool.data` parts), against (a) the torch path, `attend` over `pool.gather`, and (b) float64 attention over the
    true values decoded from the stored parts (`true_rows`). Tokens and latent columns span a decade of magnitude, so
    token and tile scales differ from one another.

    Tolerance 1e-5 of the largest output under the interpreter: every product and sum is fp32 there (2^-24
    relative rounding per operation, over C + R <= 160 products and <= 90 tokens: 2-3e-7 measured), and
    dequantization is exact (e4m3 codes times fp32 scales, powers of two in the tile layout). On CUDA tl.dot
    takes bf16 operands (the queries rounded to 8 bits of mantissa): 2e-2, as test_matches_reference allows."""
    from nano.llm import resolve_config
    from nano.model import attend

    cfg = dataclasses.replace(resolve_config("kimi-k2.6-random")[1], kv_lora_rank=c, qk_rope_head_dim=r,
                              num_hidden_layers=1)
    gen = torch.Generator().manual_seed(c * 100 + page_size + heads)
    pages_per_seq = [-(-n // page_size) for n in lens]
    pool = KVPool(cfg, kv_dtype, sum(pages_per_seq) + 2, page_size, DEVICE, layout)    # two pages never used
    assert pool.kv_layout == layout
    ids, tables = torch.randperm(pool.num_pages, generator=gen).tolist(), []
    for n, count in zip(lens, pages_per_seq):
        tables.append(ids[:count])
        ids = ids[count:]
        magnitude = 10 ** torch.empty(n, 1).uniform_(-0.5, 0.5, generator=gen)           # per token
        latent = torch.randn(n, c, generator=gen) * magnitude * torch.logspace(-0.5, 0.5, c)   # per column
        rope = torch.randn(n, r, generator=gen) * magnitude
        pool.write(0, torch.tensor(pool.slots(tables[-1], 0, n), device=DEVICE), latent.to(DEVICE), rope.to(DEVICE))
    width = max(pages_per_seq)
    page_table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)  # -1: never read
    q = torch.randn(len(lens), heads, c + r, generator=gen)
    q_abs, q_pe = q[..., :c], q[..., c:]                                               # strided views
    softmax_scale = (c + r) ** -0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    part = {name: pool.data[name][0] for name in ("kv_scale", "rope") if name in pool.data}
    out = mla.mla_decode_paged(q_abs.to(DEVICE), q_pe.to(DEVICE), pool.kv[0], part.get("kv_scale"),
                               page_table.to(DEVICE), seq_lens.to(DEVICE), softmax_scale,
                               rope_pages=part.get("rope"), num_splits=splits).cpu()
    assert out.shape == (len(lens), heads, c) and out.dtype == torch.float32

    kv, kv_scale = pool.gather(0, page_table.clamp(min=0).long().to(DEVICE), torch.float32)  # [B, S, C + R]
    allowed = torch.arange(kv.shape[1])[None, None, :] < seq_lens[:, None, None]         # [B, 1, S]
    torch_path = attend(q_abs[:, None].to(DEVICE), q_pe[:, None].to(DEVICE), kv, kv_scale, allowed.to(DEVICE),
                        softmax_scale)[:, 0].cpu()
    tol = 1e-5 if DEVICE == "cpu" else 2e-2
    assert rel_error(out, torch_path.double()) < tol
    assert rel_error(out, reference(q_abs, q_pe, true_rows(pool), page_table, lens, softmax_scale)) < tol


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="compared under the interpreter, on CPU")
@pytest.mark.parametrize("layout", ["token", "tile"])   # tensor pages take the token path's call, without scales
def test_the_engines_decode_through_the_kernel_gives_the_torch_paths_tokens(
        mla: ModuleType, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's decode steps through the Triton paged kernel (FP8 pages, with a scale per token or per tile of
    the latent and the rope key apart) give the tokens the torch path gives,
    on the shipped kimi-k2.6 trained stand-in (a DeepSeek-V3 of latent 64, rope 16: powers of two the kernel takes;
    named by its folder, so that no cached real checkpoint is picked), its experts kept in BF16 so that only the
    attention kernel runs. Its replies vary from token to token, where a tiny random model's often repeat one."""
    from nano import LLM, SamplingParams
    from nano.loader import STANDINS

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7] * 9, [1] * 40]
    outs, calls, kernel_call = {}, [], mla.mla_decode_paged
    monkeypatch.setattr(mla, "mla_decode_paged", lambda *args, **kw: calls.append(1) or kernel_call(*args, **kw))
    for kernel in ("torch", "triton"):
        llm = LLM(str(STANDINS / "kimi-k2.6"), weights="bf16", kv_dtype="fp8", kv_layout=layout, kv_budget="8MiB",
                  page_size=16, decode_kernel=kernel, progress=False)
        assert llm.engine.use_kernels == (kernel == "triton")
        outs[kernel] = [o.token_ids for o in llm.generate(prompts, params)]
        assert bool(calls) == (kernel == "triton")                                     # the kernel ran (only there)
    assert outs["torch"] == outs["triton"]


def test_malformed_inputs(mla: ModuleType) -> None:
    b, h, c, r, page_size = 2, 4, 64, 16, 16
    q_abs, q_pe = torch.randn(b, h, c), torch.randn(b, h, r)
    kv = torch.randn(6, page_size, c + r)
    table, lens = torch.zeros(b, 3, dtype=torch.int32), torch.ones(b, dtype=torch.int32)
    good = dict(q_abs=q_abs, q_pe=q_pe, kv_pages=kv, kv_scale=None, page_table=table, seq_lens=lens,
                softmax_scale=0.1)
    fp8, latent = kv.to(torch.float8_e4m3fn), kv[..., :c].to(torch.float8_e4m3fn)    # token / tensor, tile pages
    tiles, rope = torch.ones(6, page_size, 4), torch.randn(6, page_size, r, dtype=torch.bfloat16)
    bad = [
        (dict(q_abs=q_abs[0]), "expected q_abs"),                                      # wrong dims
        (dict(kv_pages=kv.view(-1, c + r)), "expected q_abs"),
        (dict(kv_pages=torch.randn(6, page_size, 2 * c + r)), "C \\+ R"),               # C mismatch
        (dict(q_pe=torch.randn(b, h, 8), kv_pages=torch.randn(6, page_size, c + 8)), "powers of two"),
        (dict(q_pe=torch.randn(b, h + 1, r)), "in B and H"),
        (dict(page_table=table.long()), "page_table must be int32"),
        (dict(page_table=table[:1]), "page_table must be int32"),
        (dict(seq_lens=lens.long()), "seq_lens must be int32"),
        (dict(kv_pages=kv.to(torch.int8)), "kv_pages dtype"),
        (dict(q_abs=q_abs.double()), "q_abs and q_pe must be"),
        (dict(kv_pages=fp8, kv_scale=torch.ones(6, page_size, dtype=torch.float64)), "kv_scale must be fp32"),
        (dict(kv_pages=fp8, kv_scale=torch.ones(6, page_size + 1)), "kv_scale must be fp32"),
        (dict(kv_scale=torch.ones(6, page_size)), "only for float8_e4m3fn"),           # scales for fp32 pages
        (dict(kv_pages=fp8, kv_scale=tiles), "kv_scale must be fp32"),                 # tile scales, no rope pages
        (dict(kv_pages=latent, kv_scale=tiles), "C \\+ R"),
        (dict(kv_pages=fp8, kv_scale=tiles, rope_pages=rope), "expected C \\(the rope key"),
        (dict(kv_pages=latent, kv_scale=tiles, rope_pages=rope[:, :, :8]), "rope_pages must be"),
        (dict(kv_pages=latent, kv_scale=tiles, rope_pages=rope.to(torch.int8)), "rope_pages must be"),
        (dict(kv_pages=latent, kv_scale=torch.ones(6, page_size, 3), rope_pages=rope), "power of two"),
        (dict(kv_pages=latent, kv_scale=torch.ones(6, page_size), rope_pages=rope), "kv_scale must be fp32"),
        (dict(kv_pages=latent, rope_pages=rope), "rope_pages come with"),              # tile pages, no scales
        (dict(q_abs=torch.randn(b, h, 2 * c)[..., ::2]), "stride 1"),
        (dict(num_splits=0), "num_splits"),
        (dict(block_n=8), "block_n=8"),                                                # below tl.dot minimum
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            mla.mla_decode_paged(**{**good, **change})
