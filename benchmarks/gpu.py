"""Every Triton kernel of nano on a GPU, in one command: correct at the real models' shapes, how fast, and nano end
to end.

    python benchmarks/gpu.py --output report.json                           # a CUDA GPU (an H200: <= 5 min)
    python benchmarks/gpu.py --output report.json --only fused_moe          # some sections again (repeatable)
    TRITON_INTERPRET=1 python benchmarks/gpu.py --toy --output r.json       # no GPU: the same code at toy shapes

Three parts, written to the JSON report and printed as tables:

1. correctness: each kernel against a PyTorch reference that dequantizes and then multiplies (or attends) in fp32,
   from the same bf16 activations and quantized weights or pages, at Kimi K2.6's and GLM-5.2's shapes:
   mla_decode_paged (BF16 pages and FP8 pages in each layout, token, tensor and tile; batch 1, 8, 64; contexts 512
   to 32768; split-K on and off),
   w4a16_gemm and fp8_gemm (Kimi's expert and attention projections, M = 1 to 512), fused_moe (INT4 and FP8
   experts; Kimi's 384 experts and GLM-5.2's 256, top-8, T = 1, 8, 64). A mismatch is one `MISMATCH ...` line
   on stderr, recorded in the JSON, and exit status 1.
2. time: each kernel's median time (CUDA events, L2 flushed before each call), its bytes over the device's copy
   bandwidth measured here, for prefill rows its FLOP/s over a measured cuBLAS BF16 peak; beside it the PyTorch
   path (dequantize, then a bf16 matmul; gather the pages, then nano.model.attend), BF16 weights, and where this
   build has them torch._weight_int4pack_mm (tinygemm) and torch._scaled_mm (FP8 W8A8).
3. end to end: nano's kimi-k2.6-random stand-in decoding at batch 1, 8 and 64 with BF16, FP8 or INT4 weights and
   BF16 or FP8 KV pages: tokens/s and TPOT.

Every figure says how it was obtained: measured on the named device, quoted (the H200 datasheet), or, under the
interpreter, correctness only. --toy runs everything at toy shapes, small enough for Triton's interpreter on CPU
(where the end-to-end part runs nano's PyTorch paths: nano uses no Triton kernel on CPU); tests/test_gpu_check.py
runs it so this script keeps working between GPU runs. Exit status: 0 when every check passed, 1 on a mismatch or
when it cannot run here (one `error:` line), 2 on a wrong command line. See docs/bench.md, "When a GPU is available".
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from nano import LLM, NanoError, kernels  # noqa: E402  (nano before torch: it sets libgomp's spin)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from rich import box  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.weights import decode_rate  # noqa: E402
from nano.config import ModelConfig  # noqa: E402
from nano.kv import quantize_fp8  # noqa: E402
from nano.loader import STANDINS  # noqa: E402
from nano.model import attend  # noqa: E402
from nano.presets import PRESETS  # noqa: E402
from nano.quant import dequantize_fp8_block, quantize_fp8_block, quantize_int4, unpack_int4  # noqa: E402

SECTIONS = ("mla_decode_paged", "w4a16_gemm", "fp8_gemm", "fused_moe", "end_to_end")
FP8_BLOCK = (128, 128)
QUOTED_H200_BF16_FLOPS = 989e12     # H200 SXM datasheet, dense BF16 tensor-core peak
# Bound on max |kernel - reference| / max |reference|, the reference computed in fp32 from the same bf16
# activations and the same quantized weights or pages (so quantization error is not part of it). On a GPU a kernel
# multiplies bf16 operands (dequantized weights and attention probabilities are rounded to bf16 first: 2^-9
# relative each, averaging out over K) and stores bf16 (half an ulp of the largest output, 2^-9; the interpreter
# truncates: 2^-8). That is a few thousandths of the largest output; 2e-2, five bf16 ulps of it, leaves room for
# the accumulation order, while a real bug (a wrong nibble, group, scale block, expert or page; a tile skipped or
# read twice) moves outputs by their own size: 0.1 to 1. The fused MoE also stores two bf16 intermediates
# (gate | up, and each route's output before the top-k sum), so 3e-2, the bound of nano's GPU kernel tests.
BOUNDS = {"mla_decode_paged": 2e-2, "w4a16_gemm": 2e-2, "fp8_gemm": 2e-2, "fused_moe": 3e-2}
INTERPRETER_LABEL = "interpreter: correctness only, time not meaningful"
Bind = Callable[[torch.Tensor], Callable[[], torch.Tensor]]   # x -> a PyTorch alternative's call on x

console = Console(width=None if sys.stdout.isatty() else 160)   # a file or pipe gets whole tables


# ---- what a run covers -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shapes:
    """The shapes one run checks and times: the real models' on a GPU (real_shapes), tiny ones for the interpreter
    (TOY)."""
    heads: int                                  # MLA: query heads H, latent C, rope R, tokens per page
    latent: int
    rope: int
    page_size: int
    softmax_scale: float
    attention_cases: tuple[tuple[int, int], ...]               # (batch, context)
    splits: tuple[int | None, ...]                             # num_splits; None: the kernel's default
    projections: tuple[tuple[str, int, int], ...]              # (name, N, K) of y = x W.T, W [N, K]
    rows: tuple[int, ...]                                      # M
    prefill_rows: int                                          # M from which a row gets a FLOP share
    group_size: int
    moe_models: tuple[tuple[str, int, int, int, int], ...]     # (name, experts E, top_k, hidden H, expert width I)
    moe_tokens: tuple[int, ...]                                # T
    e2e_model: str
    e2e_batches: tuple[int, ...]
    e2e_tokens: int                                            # generated per request
    reps: int                                                  # timed calls per figure (fewer for slow ones)
    warmup: int
    copy_bytes: int                                            # the bandwidth probe's buffer
    matmul_size: int                                           # the FLOP/s probe's square bf16 matmul


def real_shapes() -> Shapes:
    """Kimi K2.6's attention and expert shapes (and GLM-5.2's experts), from nano's presets."""
    kimi, glm = (ModelConfig.from_hf(PRESETS[name].config) for name in ("kimi-k2.6", "glm-5.2"))
    h, heads = kimi.hidden_size, kimi.num_attention_heads
    return Shapes(
        heads=heads, latent=kimi.kv_lora_rank, rope=kimi.qk_rope_head_dim, page_size=64,
        softmax_scale=kimi.softmax_scale,
        attention_cases=((1, 512), (1, 4096), (1, 32768), (8, 512), (8, 4096), (8, 32768), (64, 512), (64, 4096)),
        splits=(1, None),
        projections=(("expert gate/up", kimi.moe_intermediate_size, h), ("expert down", h, kimi.moe_intermediate_size),
                     ("q_a_proj", kimi.q_lora_rank, h), ("q_b_proj", heads * kimi.qk_head_dim, kimi.q_lora_rank),
                     ("kv_a_proj", kimi.kv_lora_rank + kimi.qk_rope_head_dim, h),
                     ("o_proj", h, heads * kimi.v_head_dim)),
        rows=(1, 8, 64, 512), prefill_rows=256, group_size=32,
        moe_models=tuple((name, c.n_routed_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size)
                         for name, c in (("kimi-k2.6", kimi), ("glm-5.2", glm))),
        moe_tokens=(1, 8, 64),
        e2e_model="kimi-k2.6-random", e2e_batches=(1, 8, 64), e2e_tokens=32,
        reps=25, warmup=3, copy_bytes=4 << 30, matmul_size=8192)


# Interpreter-sized: each kernel call a few hundred tile steps at most (the interpreter takes ~1 ms per step). The
# FP8 expert width is one 128-row scale block; prefill_rows is low only so that the FLOP-share code runs here too.
# End to end, the shipped trained stand-in of the same architecture (10M parameters, named by its folder so that no
# cached real checkpoint is picked): building the 100M-parameter random one six times was most of a toy run.
TOY = Shapes(
    heads=16, latent=64, rope=16, page_size=16, softmax_scale=(64 + 16) ** -0.5,
    attention_cases=((1, 40), (2, 100)), splits=(1, 3),
    projections=(("gate/up", 96, 256), ("down", 256, 96), ("partial blocks", 200, 160)),
    rows=(1, 5, 16), prefill_rows=16, group_size=32,
    moe_models=(("toy", 8, 2, 256, 128),), moe_tokens=(1, 4),
    e2e_model=str(STANDINS / "kimi-k2.6"), e2e_batches=(1, 2), e2e_tokens=3,
    reps=1, warmup=0, copy_bytes=32 << 20, matmul_size=256)


# ---- timing and the device's own figures -------------------------------------------------------------------------

class Clock:
    """Milliseconds per call on one device. On CUDA each call runs between two events, right after a write to a
    buffer larger than L2 evicts what earlier calls left there (a decode step reads each layer's weights once, from
    memory) and hides the call's launch; elsewhere, wall time. A slow call gets fewer repetitions (at least 3
    on CUDA): about `budget_s` per figure. `interpreted`: the kernels run in Triton's interpreter, where their time
    means nothing (INTERPRETER_LABEL), and `run_case` keeps the checked call's time rather than run one again."""

    def __init__(self, device: torch.device, reps: int, warmup: int, budget_s: float = 0.3,
                 interpreted: bool = False) -> None:
        self.device, self.reps, self.warmup, self.budget_ms = device, reps, warmup, budget_s * 1e3
        self.interpreted = interpreted
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def samples(self, fn: Callable[[], object]) -> list[float]:
        for _ in range(self.warmup):
            fn()
        times: list[float] = []
        while len(times) < self.reps and (len(times) < min(3, self.reps) or sum(times) < self.budget_ms):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                self.flush.zero_()
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                began = time.perf_counter()
                fn()
                times.append((time.perf_counter() - began) * 1e3)
        return times

    def median_ms(self, fn: Callable[[], object]) -> float:
        return statistics.median(self.samples(fn))


def copy_bandwidth(clock: Clock, nbytes: int) -> float:
    """Bytes/s of the fastest device-to-device copy of `nbytes`: bytes read + bytes written over its time."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=clock.device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (min(clock.samples(lambda: dst.copy_(src))) / 1e3)


def peak_bf16_flops(clock: Clock, size: int) -> float:
    """FLOP/s of the fastest square bf16 matmul of `size` (cuBLAS on CUDA)."""
    a, b = (torch.randn(size, size, device=clock.device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * size ** 3 / (min(clock.samples(lambda: a @ b)) / 1e3)


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Max abs error of `out` against the fp32 reference, and that over the reference's max abs value."""
    error = (out.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    return {"max_abs_error": error, "max_abs_reference": scale, "rel_error": error / scale if scale else error}


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


# ---- the rows of the kernel sections -----------------------------------------------------------------------------

def new_row(kernel: str, case: str, shape: dict, nbytes: int, flops: int | None = None) -> dict:
    """One checked and timed case. `nbytes`: what the kernel must move at least (weights and scales, or the pages
    it reads, plus activations in and out); `flops` for prefill rows only (M >= prefill_rows)."""
    return {"kernel": kernel, "case": case, "shape": shape, "bytes": nbytes, "flops": flops,
            "correctness": {"bound": BOUNDS[kernel], "passed": False}, "times_ms": {}, "baselines": {}}


def run_case(row: dict, kernel: Callable[[], torch.Tensor], ref: torch.Tensor, clock: Clock) -> None:
    """Check the kernel's output against the fp32 reference, then time it (on a GPU apart: the first call
    compiles); an exception fails the row."""
    try:
        began = time.perf_counter()
        out = kernel()
        checked_ms = (time.perf_counter() - began) * 1e3
        check = row["correctness"] = {**errors(out, ref), "bound": row["correctness"]["bound"]}
        check["passed"] = bool(check["rel_error"] <= check["bound"])                     # NaN fails
        row["times_ms"]["kernel"] = checked_ms if clock.interpreted else clock.median_ms(kernel)
    except Exception as error:   # a compile or launch failure is this row's result
        row["error"] = one_line(error)


def prepare(make: Callable[[], Bind]) -> Bind | str:
    """A PyTorch alternative, or why this build or GPU cannot make it."""
    try:
        return make()
    except Exception as error:   # any: an op this build or GPU lacks, or a shape it refuses
        return f"unavailable: {one_line(error)}"


def baseline(row: dict, name: str, bind: Bind | str, x: torch.Tensor, ref: torch.Tensor, clock: Clock) -> None:
    """Time a PyTorch alternative on x into row["times_ms"][name], with its error against the reference in
    row["baselines"]: no verdict (W8A8 also rounds the activations), but a packing this script got wrong would show
    there as an error of order 1, and the printout flags it."""
    if isinstance(bind, str):
        row["times_ms"][name] = bind
        return
    try:
        call = bind(x)
        row["baselines"][name] = errors(call(), ref)
        row["times_ms"][name] = clock.median_ms(call)
    except Exception as error:   # as in prepare
        row["times_ms"][name] = f"unavailable: {one_line(error)}"


def dequantize(weight: torch.Tensor, scale: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """One INT4 (compressed-tensors, int32 words) or FP8 (128x128 blocks) weight [N, K] -> fp32, by nano's
    functions."""
    if weight.dtype == torch.int32:
        return unpack_int4(weight, scale, (weight.shape[0], k), group_size)
    return dequantize_fp8_block(weight, scale, FP8_BLOCK)


# ---- paged MLA decode --------------------------------------------------------------------------------------------

PAGE_FORMATS = ("bf16", "fp8:token", "fp8:tensor", "fp8:tile")   # KV dtype[:FP8 layout] (nano/kv.py)


def paged_cache(lens: list[int], shapes: Shapes, form: str, gen: torch.Generator, device: torch.device
                ) -> tuple[torch.Tensor, ...]:
    """Random queries and a pool holding each sequence's tokens at shuffled pages, as nano's KV pool stores them in
    `form` -> q_abs [B, H, C] and q_pe [B, H, R] (bf16 views of one tensor), pages ([P, page_size, C + R] bf16 or
    e4m3; the tile layout: the latent [P, page_size, C] e4m3), the scale (token: fp32 [P, page_size]; tile:
    [P, page_size, 4]; else None), the tile layout's bf16 rope pages [P, page_size, R] (else None), the true values
    [P, page_size, C + R] fp32, page_table [B, max_pages] int32 (padding: page 0, never read), seq_lens [B] int32."""
    c, r, page_size = shapes.latent, shapes.rope, shapes.page_size
    per_seq = [-(-n // page_size) for n in lens]
    ids = torch.randperm(sum(per_seq), generator=gen, device=device).int()
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=device)
    offset = 0
    for b, count in enumerate(per_seq):
        table[b, :count] = ids[offset:offset + count]
        offset += count
    values = torch.randn(ids.numel(), page_size, c + r, generator=gen, device=device, dtype=torch.bfloat16)
    pages, scale, rope, true = values, None, None, values.float()
    if form == "fp8:token":
        pages, scale = quantize_fp8(values)
        true = pages.float() * scale[..., None]
    elif form == "fp8:tensor":                                       # the code is the value (scale 1)
        pages = values.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        true = pages.float()
    elif form == "fp8:tile":                                         # a power-of-two scale per quarter of the latent
        pages, scale = quantize_fp8(values[..., :c], c // 4)
        rope = values[..., c:]
        true = torch.cat([(pages.float().unflatten(-1, (4, -1)) * scale[..., None]).flatten(-2), rope.float()], -1)
    q = torch.randn(len(lens), shapes.heads, c + r, generator=gen, device=device, dtype=torch.bfloat16)
    return q[..., :c], q[..., c:], pages, scale, rope, true, table, torch.tensor(lens, dtype=torch.int32, device=device)


def torch_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, scale: torch.Tensor | None,
                    table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float, dtype: torch.dtype
                    ) -> torch.Tensor:
    """nano's PyTorch decode path: gather each sequence's pages (as KVPool.gather does), then nano.model.attend,
    in `dtype` -> [B, H, C]. `pages` [P, page_size, C + R] with a per-token `scale` or values (scale None)."""
    batch, max_pages = table.shape
    kv = pages[table.long()].view(batch, max_pages * pages.shape[1], -1).to(dtype)          # [B, S, C + R]
    kv_scale = None if scale is None else scale[table.long()].view(batch, -1)               # [B, S]
    allowed = torch.arange(kv.shape[1], device=kv.device) < seq_lens[:, None]               # [B, S]
    return attend(q_abs[:, None].to(dtype), q_pe[:, None].to(dtype), kv, kv_scale, allowed[:, None],
                  softmax_scale)[:, 0]


def check_attention(rows: list[dict], shapes: Shapes, clock: Clock, gen: torch.Generator,
                    device: torch.device) -> None:
    for form in PAGE_FORMATS:
        for batch, context in shapes.attention_cases:
            lens = [context - (37 * b) % 61 for b in range(batch)]            # ragged, mostly not page-aligned
            q_abs, q_pe, pages, scale, rope, true, table, seq_lens = paged_cache(lens, shapes, form, gen, device)
            # the reference attends over the true values in fp32; the torch path times what nano's gather reads
            ref = torch_attention(q_abs, q_pe, true, None, table, seq_lens, shapes.softmax_scale, torch.float32)
            per_token = scale if form == "fp8:token" else None
            readable = pages if form in ("bf16", "fp8:token") else true
            torch_ms = clock.median_ms(lambda: torch_attention(q_abs, q_pe, readable, per_token, table, seq_lens,
                                                               shapes.softmax_scale, torch.bfloat16))
            token_bytes = sum(t[0, 0].numel() * t.element_size() for t in (pages, scale, rope) if t is not None)
            moved = sum(lens) * token_bytes + 2 * batch * shapes.heads * (2 * shapes.latent + shapes.rope)
            for splits in shapes.splits:
                row = new_row("mla_decode_paged", f"{form} pages, B={batch}, context {context}, "
                              f"num_splits={splits or 'default'}",
                              {"B": batch, "H": shapes.heads, "C": shapes.latent, "R": shapes.rope, "context": context,
                               "page_size": shapes.page_size, "pages": form, "num_splits": splits}, moved)
                run_case(row, lambda: kernels.mla_decode_paged(q_abs, q_pe, pages, scale, table, seq_lens,
                                                               shapes.softmax_scale, num_splits=splits,
                                                               rope_pages=rope), ref, clock)
                row["times_ms"]["torch gather + attend"] = torch_ms
                rows.append(row)


# ---- W4A16 and FP8 GEMMs -----------------------------------------------------------------------------------------

def tinygemm(weight_packed: torch.Tensor, weight_scale: torch.Tensor, k: int, group_size: int) -> Bind:
    """torch._weight_int4pack_mm (tinygemm) on the same INT4 weight: its codes two per byte (even k in the high
    nibble) for _convert_weight_to_int4pack, and (scale, zero = 0) pairs, since tinygemm's (code - 8) * scale + zero
    is compressed-tensors' q * scale with code = q + 8."""
    n = weight_packed.shape[0]
    codes = (unpack_int4(weight_packed, torch.ones_like(weight_scale), (n, k), group_size) + 8).to(torch.uint8)
    tiled = torch.ops.aten._convert_weight_to_int4pack(codes[:, ::2] << 4 | codes[:, 1::2], 8)   # codes [N, K]
    scale_t = weight_scale.to(torch.bfloat16).t()                                                # [K/G, N]
    scales_and_zeros = torch.stack([scale_t, torch.zeros_like(scale_t)], -1).contiguous()        # [K/G, N, 2]
    return lambda x: lambda: torch._weight_int4pack_mm(x, tiled, group_size, scales_and_zeros)


def scaled_mm(dense: torch.Tensor) -> Bind:
    """torch._scaled_mm as FP8 W8A8 with row-wise scales: the weight [N, K] re-quantized per output row, the
    activations per row, beforehand (the timed call is the tensor-core matmul alone)."""
    w8, w_scale = quantize_fp8(dense)                                                            # [N, K], [N]

    def bind(x: torch.Tensor) -> Callable[[], torch.Tensor]:
        x8, x_scale = quantize_fp8(x)                                                            # [M, K], [M]
        return lambda: torch._scaled_mm(x8, w8.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :],
                                        out_dtype=x.dtype)
    return bind


def check_gemm(rows: list[dict], kernel: str, shapes: Shapes, clock: Clock, gen: torch.Generator,
               device: torch.device) -> None:
    """w4a16_gemm (INT4, group G) or fp8_gemm (128x128 blocks) on each projection at each M."""
    group = shapes.group_size
    for name, n, k in shapes.projections:
        w = torch.randn(n, k, generator=gen, device=device) * 0.02                      # fp32 [N, K]
        int4 = kernel == "w4a16_gemm"
        weight, scale = quantize_int4(w, group) if int4 else quantize_fp8_block(w)
        dense = dequantize(weight, scale, k, group)                                       # fp32 [N, K]
        dense_bf16 = dense.to(torch.bfloat16)
        if int4:
            call = lambda x: kernels.w4a16_gemm(x, weight, scale, group)
            alternative = ("tinygemm", prepare(lambda: tinygemm(weight, scale, k, group)))
        else:
            call = lambda x: kernels.fp8_gemm(x, weight, scale, FP8_BLOCK)
            alternative = ("_scaled_mm W8A8", prepare(lambda: scaled_mm(dense)))
        fmt = {"group_size": group} if int4 else {"block": list(FP8_BLOCK)}
        for m in shapes.rows:
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            moved = weight.nbytes + scale.nbytes + x.nbytes + m * n * x.element_size()
            row = new_row(kernel, f"{name} {n}x{k}, M={m}", {"M": m, "N": n, "K": k, **fmt}, moved,
                          2 * m * n * k if m >= shapes.prefill_rows else None)
            ref = F.linear(x.float(), dense)
            run_case(row, lambda: call(x), ref, clock)
            row["times_ms"]["torch dequantize + matmul"] = clock.median_ms(
                lambda: F.linear(x, dequantize(weight, scale, k, group).to(x.dtype)))
            row["times_ms"]["torch bf16 weights"] = clock.median_ms(lambda: F.linear(x, dense_bf16))
            baseline(row, *alternative, x, ref, clock)
            rows.append(row)


# ---- fused MoE ---------------------------------------------------------------------------------------------------

def random_experts(fmt: str, experts: int, n: int, k: int, group_size: int, gen: torch.Generator,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """E random expert weights [E, N, K], made directly in the stored layout (quantizing 384 full-size matrices
    would take longer than the check): INT4 random words (codes uniform in -8..7) with bf16 group scales, or the
    e4m3 rounding of a normal draw with fp32 128x128 block scales. Either way a weight's entries are ~0.03."""
    if fmt == "int4":
        words = torch.randint(-2 ** 31, 2 ** 31, (experts, n, k // 8), generator=gen, device=device,
                              dtype=torch.int32)
        scale = torch.rand(experts, n, k // group_size, generator=gen, device=device) * 0.005 + 0.005
        return words, scale.to(torch.bfloat16)
    codes = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn, device=device)
    for first in range(0, experts, 16):                                               # 16 experts of bf16 at a time
        codes[first:first + 16] = torch.randn(codes[first:first + 16].shape, generator=gen, device=device,
                                              dtype=torch.bfloat16)
    blocks = (experts, math.ceil(n / FP8_BLOCK[0]), math.ceil(k / FP8_BLOCK[1]))
    return codes, torch.rand(blocks, generator=gen, device=device) * 0.02 + 0.02


def torch_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
              w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, group_size: int,
              dtype: torch.dtype) -> torch.Tensor:
    """The routed experts in PyTorch, one chosen expert at a time: dequantize it, silu(gate) * up and down in
    `dtype`, then weight and sum each token's routes -> [T, H] fp32. Experts no token chose are never read."""
    hidden, inter = x.shape[1], w13.shape[1] // 2
    out = torch.zeros(x.shape, device=x.device)
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)                    # its routes
        w_gate_up = dequantize(w13[expert], w13_scale[expert], hidden, group_size).to(dtype)      # [2I, H]
        gate, up = F.linear(x[token].to(dtype), w_gate_up).split(inter, -1)
        y = F.linear(F.silu(gate) * up, dequantize(w2[expert], w2_scale[expert], inter, group_size).to(dtype))
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
    return out


def check_moe(rows: list[dict], shapes: Shapes, clock: Clock, gen: torch.Generator, device: torch.device) -> None:
    group = shapes.group_size
    for model, experts, top_k, hidden, inter in shapes.moe_models:
        for fmt in ("int4", "fp8"):
            w13, w13_scale = random_experts(fmt, experts, 2 * inter, hidden, group, gen, device)
            w2, w2_scale = random_experts(fmt, experts, hidden, inter, group, gen, device)
            weights = (w13, w13_scale, w2, w2_scale)
            expert_bytes = sum(t[0].nbytes for t in weights)
            for tokens in shapes.moe_tokens:
                x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16)
                topk_ids = torch.rand(tokens, experts, generator=gen, device=device).topk(top_k).indices  # distinct
                topk_weights = torch.rand(tokens, top_k, generator=gen, device=device) + 0.1
                topk_weights /= topk_weights.sum(-1, keepdim=True)
                chosen = topk_ids.unique().numel()
                moved = chosen * expert_bytes + 2 * x.nbytes + topk_ids.nbytes + topk_weights.nbytes
                row = new_row("fused_moe", f"{model} {fmt}, E={experts} top-{top_k}, T={tokens}",
                              {"T": tokens, "E": experts, "top_k": top_k, "H": hidden, "I": inter, "format": fmt,
                               "experts_chosen": chosen}, moved)
                routing = (topk_ids, topk_weights, group)
                ref = torch_moe(x, *weights, *routing, torch.float32)
                run_case(row, lambda: kernels.fused_moe(x, *weights, topk_ids, topk_weights, weight_format=fmt,
                                                        group_size=group if fmt == "int4" else None), ref, clock)
                row["times_ms"]["torch dequantize + matmul"] = clock.median_ms(
                    lambda: torch_moe(x, *weights, *routing, torch.bfloat16))
                rows.append(row)


# ---- end to end --------------------------------------------------------------------------------------------------

def end_to_end(rows: list[dict], shapes: Shapes, device: torch.device) -> None:
    """nano's stand-in decoding (greedy, ignore_eos, 16-token prompts) per weights x KV format and batch. Each batch
    runs once unmeasured first: the kernels it needs (their block sizes depend on the batch) compile then."""
    for weights in ("bf16", "fp8", "int4"):
        for kv_dtype in ("bf16", "fp8"):
            llm = LLM(shapes.e2e_model, weights=weights, kv_dtype=kv_dtype, device=str(device), dtype="bfloat16",
                      kv_budget="64MiB", max_step_tokens=1024, progress=False)
            for batch in shapes.e2e_batches:
                decode_rate(llm, batch, 2)
                rate = decode_rate(llm, batch, shapes.e2e_tokens)
                rows.append({"weights": weights, "kv_dtype": kv_dtype, "batch": batch, "tokens": shapes.e2e_tokens,
                             "tok_s": rate, "tpot_ms": batch / rate * 1e3, "triton_kernels": llm.engine.use_kernels})


# ---- the report --------------------------------------------------------------------------------------------------

def add_shares(rows: list[dict], copy_bytes_per_s: float, peak_flops: float) -> None:
    """A kernel row's bytes/s and its share of the measured copy bandwidth; a prefill row's share of peak FLOP/s."""
    for row in rows:
        ms = row["times_ms"].get("kernel")
        if isinstance(ms, float) and ms > 0:
            row["kernel_bytes_per_s"] = row["bytes"] / (ms / 1e3)
            row["copy_bandwidth_share"] = row["kernel_bytes_per_s"] / copy_bytes_per_s
            row["peak_flop_share"] = row["flops"] / (ms / 1e3) / peak_flops if row["flops"] else None


def failure_lines(sections: dict) -> list[str]:
    """One line per failed check, kernel error or section that stopped."""
    lines = []
    for name, section in sections.items():
        if "error" in section:
            lines.append(f"FAILED {name}: {section['error']}")
        for row in section.get("rows", []) if name != "end_to_end" else []:
            check = row["correctness"]
            if "error" in row:
                lines.append(f"FAILED {row['kernel']} {row['case']}: {row['error']}")
            elif not check["passed"]:
                lines.append(f"MISMATCH {row['kernel']} {row['case']}: max abs error / max abs reference = "
                             f"{check['rel_error']:.3g} > {check['bound']:g}")
    return lines


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def run(shapes: Shapes, device: torch.device, toy: bool, selected: set[str], interpreted: bool) -> dict:
    started = time.perf_counter()
    clock = Clock(device, shapes.reps, shapes.warmup, interpreted=interpreted)
    gen = torch.Generator(device=device).manual_seed(0)
    measured = f"measured on {device_name(device)}" + (" at toy shapes" if toy else "")
    kernel_label = INTERPRETER_LABEL if interpreted else measured
    copy_bw, peak = copy_bandwidth(clock, shapes.copy_bytes), peak_bf16_flops(clock, shapes.matmul_size)
    figures = {
        "copy_bandwidth_bytes_per_s": {"value": copy_bw, "obtained": f"{measured}: the fastest device-to-device copy "
                                       f"of {shapes.copy_bytes >> 20} MiB, bytes read + written / time"},
        "peak_bf16_flop_per_s": {"value": peak, "obtained": f"{measured}: the fastest {shapes.matmul_size}^3 bf16 "
                                 f"matmul{' (cuBLAS)' if device.type == 'cuda' else ''}, 2 N^3 / time"},
        "quoted_peak_bf16_flop_per_s": {"value": QUOTED_H200_BF16_FLOPS,
                                        "obtained": "quoted: H200 datasheet, dense BF16"},
    }
    checks: dict[str, Callable[[list[dict]], None]] = {
        "mla_decode_paged": lambda rows: check_attention(rows, shapes, clock, gen, device),
        "w4a16_gemm": lambda rows: check_gemm(rows, "w4a16_gemm", shapes, clock, gen, device),
        "fp8_gemm": lambda rows: check_gemm(rows, "fp8_gemm", shapes, clock, gen, device),
        "fused_moe": lambda rows: check_moe(rows, shapes, clock, gen, device),
        "end_to_end": lambda rows: end_to_end(rows, shapes, device),
    }
    sections: dict[str, dict] = {}
    for name in SECTIONS:
        if name not in selected:
            sections[name] = {"status": "skipped (--only)"}
            continue
        console.print(f"{name} ...", style="dim")
        began, rows = time.perf_counter(), []
        section: dict = {"status": "ran", "rows": rows}
        try:
            checks[name](rows)
        except Exception as error:   # recorded; the next section still runs
            section["error"] = one_line(error)
            section["status"] = "stopped by an error"
        if name == "end_to_end":
            section["obtained"] = (f"{measured}; " + ("nano's Triton kernels where triton_kernels is true" if
                                   device.type == "cuda" else "nano's PyTorch paths: nano uses no Triton kernel "
                                   "on CPU"))
        else:
            add_shares(rows, copy_bw, peak)
            section["obtained"] = {"kernel": kernel_label, "torch": measured,
                                   "timing": f"median of up to {shapes.reps} calls after {shapes.warmup} warm-up "
                                             f"calls" + (", CUDA events, L2 flushed before each call"
                                                         if device.type == "cuda" else ", wall clock")}
        section["wall_s"] = time.perf_counter() - began
        sections[name] = section
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failures = failure_lines(sections)
    return {"script": "benchmarks/gpu.py", "mode": "toy" if toy else "real shapes",
            "environment": {"device": device_name(device), "torch": torch.__version__,
                            "triton": importlib.metadata.version("triton"), "cuda": torch.version.cuda,
                            "python": platform.python_version(), "interpreter": interpreted,
                            "time": datetime.now(timezone.utc).isoformat(timespec="seconds")},
            "settings": asdict(shapes), "tolerances": {"bound": BOUNDS, "measure": "max |kernel - reference| / "
                                                       "max |reference|, reference in fp32"},
            "device_figures": figures, "sections": sections, "failures": failures, "passed": not failures,
            "wall_s": time.perf_counter() - started}


# ---- the printout ------------------------------------------------------------------------------------------------

def ms_cell(value: float | str, kernel_ms: float | str | None = None) -> str:
    if not isinstance(value, float):
        return "n/a"
    if isinstance(kernel_ms, float) and kernel_ms > 0:
        return f"{value:.3f} ({value / kernel_ms:.1f}×)"
    return f"{value:.3f}"


def print_kernel_section(name: str, section: dict) -> None:
    rows = section["rows"]
    others = list(dict.fromkeys(key for row in rows for key in row["times_ms"] if key != "kernel"))
    prefill = any(row["flops"] for row in rows)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=f"[bold]{name}[/bold]", title_justify="left")
    heads = ["case", "rel err", "", "kernel ms", "GB/s", "% copy BW"] + (["% peak"] if prefill else []) + others
    for i, head in enumerate(heads):
        table.add_column(head, justify="left" if i == 0 else "right", no_wrap=True)
    unavailable: dict[str, str] = {}
    for row in rows:
        check, kernel_ms = row["correctness"], row["times_ms"].get("kernel")
        verdict = "ok" if check["passed"] else ("[red]FAILED[/red]" if "error" in row else "[red]MISMATCH[/red]")
        cells = [row["case"], f"{check['rel_error']:.1e}" if "rel_error" in check else "-", verdict,
                 ms_cell(kernel_ms), f"{row['kernel_bytes_per_s'] / 1e9:,.0f}" if "kernel_bytes_per_s" in row else "-",
                 f"{100 * row['copy_bandwidth_share']:.0f}%" if "copy_bandwidth_share" in row else "-"]
        if prefill:
            share = row.get("peak_flop_share")
            cells.append(f"{100 * share:.0f}%" if share else "")
        for key in others:
            value = row["times_ms"].get(key, "")
            if isinstance(value, str) and value:
                unavailable[key] = value
            cells.append(ms_cell(value, kernel_ms) if value != "" else "")
        table.add_row(*cells)
    console.print(table)
    obtained = section["obtained"]
    console.print(f"kernel times: {obtained['kernel']}; PyTorch times: {obtained['torch']}; {obtained['timing']}. "
                  f"(×) = that time / the kernel's. GB/s = the bytes the kernel must move / its time; % copy BW = "
                  f"that over the measured copy bandwidth; % peak = FLOP/s over the measured bf16 peak "
                  f"(M >= prefill rows). rel err = max abs error / max abs fp32 reference, bound "
                  f"{BOUNDS[name]:g}.", style="dim")
    for key, reason in unavailable.items():
        console.print(f"{key}: {reason}", style="dim", markup=False)
    for row in rows:
        for key, check in row["baselines"].items():
            if not check["rel_error"] <= 0.1:
                console.print(f"{key} disagrees with the reference in {row['case']} (rel err {check['rel_error']:.2g}):"
                              f" its time may be of a wrongly packed weight", style="yellow", markup=False)
    if "error" in section:
        console.print(f"stopped: {section['error']}", style="red", markup=False)


def print_end_to_end(section: dict) -> None:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="[bold]end to end[/bold]", title_justify="left")
    for i, head in enumerate(("weights", "KV", "batch", "tok/s", "TPOT ms", "Triton kernels")):
        table.add_column(head, justify="left" if i < 2 else "right", no_wrap=True)
    for row in section["rows"]:
        table.add_row(row["weights"], row["kv_dtype"], str(row["batch"]), f"{row['tok_s']:,.1f}",
                      f"{row['tpot_ms']:.2f}", "yes" if row["triton_kernels"] else "no")
    console.print(table)
    console.print(f"{section['obtained']}. Greedy decoding, ignore_eos, 16-token prompts; tok/s = tokens after each "
                  f"request's first / decode time; TPOT = the slowest request's time per output token "
                  f"(batch / tok/s).", style="dim")
    if "error" in section:
        console.print(f"stopped: {section['error']}", style="red", markup=False)


def print_report(report: dict) -> None:
    env, figures = report["environment"], report["device_figures"]
    console.print(f"\n[bold]nano GPU check[/bold] · {report['mode']} · {env['device']} · torch {env['torch']} · "
                  f"triton {env['triton']}{' (interpreter)' if env['interpreter'] else ''}")
    for key, name, unit, scale in (("copy_bandwidth_bytes_per_s", "copy bandwidth", "GB/s", 1e9),
                                   ("peak_bf16_flop_per_s", "peak BF16", "TFLOP/s", 1e12),
                                   ("quoted_peak_bf16_flop_per_s", "peak BF16", "TFLOP/s", 1e12)):
        console.print(f"{name}: {figures[key]['value'] / scale:,.4g} {unit}, {figures[key]['obtained']}")
    for name, section in report["sections"].items():
        console.print()
        if section["status"].startswith("skipped"):
            console.print(f"{name}: {section['status']}")
        elif name == "end_to_end":
            print_end_to_end(section)
        else:
            print_kernel_section(name, section)
    checks = [row["correctness"]["passed"] for name, section in report["sections"].items()
              if name != "end_to_end" for row in section.get("rows", [])]
    console.print(f"\n{sum(checks)} of {len(checks)} kernel checks passed; {len(report['failures'])} failure(s)",
                  style="bold" if report["passed"] else "bold red")
    console.print(f"{report['wall_s']:.0f} s in all ("
                  + ", ".join(f"{name} {s['wall_s']:.0f} s" for name, s in report["sections"].items() if "wall_s" in s)
                  + ")", style="dim")


# ---- main --------------------------------------------------------------------------------------------------------

def pick_device(toy: bool) -> torch.device:
    """Where the kernels run, or a NanoError that says in one line why they cannot run here."""
    kernels.require_triton("benchmarks/gpu.py")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted and not toy:
        raise NanoError("TRITON_INTERPRET=1 runs the kernels in Triton's interpreter, far too slow for the real "
                        "shapes: add --toy, or unset it on a GPU")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not toy:
        raise NanoError("benchmarks/gpu.py needs a CUDA GPU; without one, `TRITON_INTERPRET=1 python "
                        "benchmarks/gpu.py --toy --output FILE` runs its toy shapes on CPU")
    if not interpreted:
        raise NanoError("--toy without a GPU runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
                        "before python starts")
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, metavar="FILE", help="where to write the JSON report")
    parser.add_argument("--toy", action="store_true",
                        help="toy shapes: with TRITON_INTERPRET=1, on CPU (correctness only)")
    parser.add_argument("--only", action="append", choices=SECTIONS, metavar="SECTION",
                        help=f"run only this section (repeatable): {', '.join(SECTIONS)}")
    args = parser.parse_args(argv)
    output = Path(args.output).expanduser()
    try:
        device = pick_device(args.toy)
        if not output.parent.is_dir():
            raise NanoError(f"--output {args.output}: the folder {output.parent} does not exist")
    except NanoError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    from nano.kernels.common import INTERPRETED   # imports triton, which reads TRITON_INTERPRET then

    report = run(TOY if args.toy else real_shapes(), device, args.toy, set(args.only or SECTIONS), INTERPRETED)
    output.write_text(json.dumps(report, indent=2))
    print_report(report)
    console.print(f"wrote {output}", style="dim")
    for line in report["failures"]:
        print(line, file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
