"""`LLM`: the Python API — load a model, then generate, stream or score.

Data flows one way: a prompt becomes an engine `Request`; the engine's scheduler batches it with the others
(continuous batching over the paged KV pool); the model runner computes each step; the sampler picks tokens;
finished requests become `RequestOutput`s.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nano.config import ModelConfig
from nano.engine import Engine
from nano.errors import NanoError
from nano.kernels import require_triton, triton_available
from nano.loader import Resolved, load_weights, read_config, resolve_model
from nano.kv import KVPool, default_kv_budget, parse_bytes
from nano import parallel
from nano.model import Transformer
from nano.quant import convert_weights, unquantized_modules, weight_bytes_by_format
from nano.sampling import SamplingParams
from nano.scheduler import Request, latency_metrics
from nano.tokenizer import Tokenizer, load_tokenizer, utf8_text

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str            # "stop" | "length" | "abort"
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def resolve_config(model: str, weights_dir: str | None = None) -> tuple[Resolved, ModelConfig]:
    """Where a model comes from (checkpoint or nano stand-in) and its config — no weights loaded."""
    resolved = resolve_model(model, weights_dir)
    raw = resolved.preset.nano_config if resolved.kind == "nano" else read_config(resolved.path)
    return resolved, ModelConfig.from_hf(raw)


def encode_prompt(prompt: str | list[int], name: str, tokenizer: Tokenizer, config: ModelConfig) -> list[int]:
    """A prompt (text, tokenized as is, or token ids) as checked token ids; `name` says which prompt in errors."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(utf8_text(prompt, name))
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < config.vocab_size]
        if bad:
            raise NanoError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    else:
        raise NanoError(f"{name} must be a string or a list of token ids")
    if not ids:
        raise NanoError(f"{name} is empty")
    if len(ids) >= config.max_position_embeddings:
        raise NanoError(f"{name} is {len(ids)} tokens but the model's context is {config.max_position_embeddings} "
                        f"tokens (prompt + output)")
    return ids


def default_device() -> torch.device:
    """Where an LLM runs unless told: the GPU when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> str:
    """The weights' and activations' dtype unless told: bfloat16 on a GPU, float32 on CPU."""
    return "bfloat16" if device.type == "cuda" else "float32"


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a model's matmuls run in. A CPU without a bfloat16 matmul unit (no AVX512-BF16, no AMX) gets
    PyTorch's bf16 GEMM 6-8x slower than its fp32 one (measured on this project's AVX2 machine, docs/bench.md),
    so there a bfloat16 model holds its bf16 weight values in float32 (exactly: every bf16 is a float32) and
    computes in float32. What stays bfloat16: the KV pages (kv_dtype auto), the INT4 kernel's activations."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")     # torch.cpu's (private) CPU feature checks
    native = device.type != "cpu" or any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return torch.float32 if dtype == torch.bfloat16 and not native else dtype


def model_kv_dtype(dtype: str) -> str:
    """The KV dtype `auto` stands for: the model's own precision, exact against the reference."""
    return "bf16" if DTYPES.get(dtype) == torch.bfloat16 else "fp32"


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads() -> int:
    """torch's thread count when the caller gives none: OMP_NUM_THREADS when set; one thread when libgomp spins
    its long default (torch was imported before nano, and no OMP_WAIT_POLICY / GOMP_SPINCOUNT: nano/__init__.py);
    otherwise one per core this process may use, less one per CPU that other processes keep busy (the 1-minute
    load average beyond the idle CPUs), at least one. Threads that outnumber the free cores wait for each other at
    every op: measured here on 2 cores beside 4 busy processes, two (sleeping) threads took about twice as long as
    one, and two spinning threads 7x (benchmarks/shared_cores.py, docs/cli.md)."""
    cores = usable_cores()
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        return 1
    try:
        spare = (os.cpu_count() or cores) - os.getloadavg()[0]
    except OSError:            # no load average on this system
        return cores
    return max(1, min(cores, math.ceil(spare)))


class LLM:
    def __init__(self, model: str, *, weights: str = "auto", weights_dir: str | None = None,
                 prefill_weights: str | None = None, decode_weights: str | None = None, dtype: str | None = None,
                 device: str | None = None, seed: int = 0, kv_dtype: str = "auto",
                 kv_budget: str | int | None = None, page_size: int = 64, max_running: int = 256,
                 max_step_tokens: int = 512, decode_kernel: str = "auto", int4_all: bool = False,
                 int4_group_size: int = 32, integrity: bool = True, prefix_cache: bool = True, progress: bool = True,
                 tp: int = 1, threads: int | None = None) -> None:
        """`prefix_cache`: share the KV pages of token prefixes seen before (nano/kv.py, docs/prefix-cache.md).
        `threads`: torch's CPU threads for this process (default: `default_threads()`; torch's setting is global).
        `tp` > 1 splits the model over that many ranks (nano/parallel.py): this process is rank 0 and starts the
        others, unless a launcher (torchrun) started every rank, in which case ranks other than 0 call `serve()`."""
        # the other ranks build the same LLM from these (JSON: plain values only)
        rank_args = dict(model=model, weights=weights, weights_dir=weights_dir, prefill_weights=prefill_weights,
                         decode_weights=decode_weights, dtype=dtype, seed=seed, kv_dtype=kv_dtype,
                         kv_budget=kv_budget, page_size=page_size, max_running=max_running,
                         max_step_tokens=max_step_tokens, decode_kernel=decode_kernel, int4_all=int4_all,
                         int4_group_size=int4_group_size, integrity=integrity, prefix_cache=prefix_cache,
                         progress=False, tp=tp)
        if threads is not None and not 1 <= threads <= usable_cores():
            raise NanoError(f"threads must be between 1 and the {usable_cores()} cores this process may use, "
                            f"got {threads}")
        torch.set_num_threads(threads or default_threads())
        resolved, self.config = resolve_config(model, weights_dir)
        self.group = parallel.join(tp, rank_args, self.config)
        with parallel.stopped_on_error(self.group):   # a rank 0 that fails to build leaves no ranks behind
            self.rank = 0 if self.group is None else self.group.rank
            self.device = self.group.device if self.group else torch.device(device) if device else default_device()
            dtype = dtype or default_dtype(self.device)
            if dtype not in DTYPES:
                raise NanoError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
            self.dtype, self.seed = DTYPES[dtype], seed
            # a checkpoint's weights are allocated as they are read, each in the format the checkpoint stores
            self.model = Transformer(self.config, self.dtype, self.device, materialize=resolved.kind == "nano")
            if resolved.kind == "nano":
                self.model.init_random(seed)   # the whole model, then this rank's part: any --tp draws the same weights
            sharding = None if self.group is None else parallel.shard(self.model, self.group)
            if resolved.kind != "nano":
                load_weights(self.model, resolved.path, self.config, progress=progress and self.rank == 0,
                             sharding=sharding)
            # one format for both phases, or prefill and decode each their own (e.g. FP8 prefill, INT4 decode)
            self.prefill_weights, self.decode_weights = prefill_weights or weights, decode_weights or weights
            convert_weights(self.model, self.prefill_weights, self.decode_weights, self.dtype, int4_all,
                            int4_group_size, keep=unquantized_modules(self.config.quantization_config))
            self.compute_dtype = compute_dtype(self.dtype, self.device)
            self.model.hold_weights_in(self.compute_dtype)
            self.tokenizer = load_tokenizer(resolved.path, self.config)
            if self.tokenizer.vocab_size > self.config.vocab_size:
                raise NanoError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                                f"{self.config.vocab_size}: tokenizer and weights do not belong together")
            self.label = resolved.label
            self.max_context = self.config.max_position_embeddings
            if kv_dtype == "auto":
                kv_dtype = model_kv_dtype(dtype)
            budget = default_kv_budget(self.device) if kv_budget is None else parse_bytes(kv_budget)
            self.pool = KVPool.from_budget(self.config, kv_dtype, budget, page_size, self.device)
            if decode_kernel not in ("auto", "triton", "torch"):
                raise NanoError(f"decode_kernel must be auto, triton or torch, got {decode_kernel!r}")
            if decode_kernel == "triton":
                require_triton("decode_kernel='triton'")
            if decode_kernel == "triton" and not triton_available():
                raise NanoError("decode_kernel='triton' needs triton and a GPU (or TRITON_INTERPRET=1 for testing)")
            fits = all(d >= 16 and d & (d - 1) == 0 for d in (self.config.kv_lora_rank, self.config.qk_rope_head_dim))
            if decode_kernel == "triton" and not fits:
                raise NanoError(f"the Triton MLA kernel needs kv_lora_rank and qk_rope_head_dim to be powers of two "
                                f">= 16 (this model: {self.config.kv_lora_rank}, {self.config.qk_rope_head_dim})")
            use_kernel = decode_kernel == "triton" or (decode_kernel == "auto" and self.device.type == "cuda"
                                                       and triton_available() and fits)
            self.last_request: Request | None = None
            self.use_kernels = use_kernel
            eos = set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids)
            self.engine = Engine(self.model, self.pool, eos,
                                 max_running=max_running, max_step_tokens=max_step_tokens, seed=seed,
                                 use_kernels=use_kernel, integrity=integrity, prefix_cache=prefix_cache,
                                 phase_weights=self.prefill_weights != self.decode_weights,
                                 peers=parallel.Peers(self.group) if self.group and self.rank == 0 else None)

    # ---- public API ---------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Ranks other than 0 of a tensor-parallel LLM: run the passes rank 0 sends until it stops."""
        if self.group is None or self.rank == 0:
            raise NanoError("serve() is for ranks other than 0 of a tensor-parallel LLM")
        parallel.serve(self.model, self.pool, self.group, self.use_kernels)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel LLM (also done at exit); nothing for a single device."""
        if self.group is not None:
            self.group.stop()

    def weight_bytes(self) -> dict[str, int]:
        """Resident weight bytes by storage format (e.g. {"bf16": ..., "int4": ...})."""
        return weight_bytes_by_format(self.model)

    def generate(self, prompts: Sequence[str | list[int]], params: SamplingParams | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion, all together in the engine; outputs come back in prompt order."""
        params = params or SamplingParams()
        names = [f"prompt {i}" if len(prompts) > 1 else "prompt" for i in range(len(prompts))]
        ids = [self._prompt_ids(p, name) for p, name in zip(prompts, names)]
        requests = [self._submit(prompt_ids, params) for prompt_ids in ids]
        while not all(r.finished for r in requests):
            self.poll()
        return [self.output(r) for r in requests]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[int]:
        """Yield the generated token ids of one prompt as they are produced. Once the stream is exhausted,
        `llm.last_output` holds its RequestOutput (finish reason, text, metrics) and `llm.last_request` the
        engine's record of it (page table, timings)."""
        request = self.last_request = self._submit(self._prompt_ids(prompt, "prompt"), params or SamplingParams())
        try:
            while not request.finished:
                for r, token in self.engine.step():
                    if r is request and token is not None:
                        yield token
        finally:  # also when the caller stops early (Ctrl-C, break): the request must not keep its pages
            self.engine.abort(request, "the stream was closed before the request finished")
            self.last_output = self.output(request)

    def submit(self, prompt: str | list[int], params: SamplingParams, name: str = "prompt") -> Request:
        """Queue one prompt; `poll()` advances it. The request's fields say where it is (finished, output token
        ids, token_times); `SplitLLM` has the same submit/poll pair."""
        return self._submit(self._prompt_ids(prompt, name), params)

    def poll(self) -> None:
        """One engine step."""
        self.engine.step()

    def abort(self, request: Request, error: str) -> None:
        """End a submitted request its caller gave up on, freeing its pages (`SplitLLM.abort` likewise)."""
        self.engine.abort(request, error)

    def counters(self, reset: bool = False) -> dict[str, Any]:
        """The engine's counters (steps, preemptions, peak running, peak pages), the KV pool's size and the
        integrity counts; `reset` starts the counters afresh (after a benchmark's warm-up)."""
        pool = self.pool
        figures = {**self.engine.counters(), "kv_dtype": pool.kv_dtype, "num_pages": pool.num_pages,
                   "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                   "page_size": pool.page_size, "kv_tokens": pool.tokens, "kv_bytes": pool.nbytes}
        if reset:
            self.engine.reset_counters()
        return figures

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [T, vocab] (fp32): the tokens go through the same pages and chunked prefill as
        generation, so row t is the distribution of token t + 1."""
        return self.engine.score(self._prompt_ids(token_ids, "token_ids"))

    # ---- requests ----------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int], name: str) -> list[int]:
        return encode_prompt(prompt, name, self.tokenizer, self.config)

    def _submit(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        return self.engine.add(prompt_ids, params, min(len(prompt_ids) + params.max_tokens, self.max_context))

    def output(self, r: Request) -> RequestOutput:
        """An engine request as a RequestOutput: its text without the stop token, its finish reason and metrics
        (the split's decode worker reports its requests with it)."""
        ids = r.output_token_ids
        text_ids = ids[:-1] if r.finish_reason == "stop" else ids  # the stop token is not part of the text
        metrics = {"prompt_tokens": len(r.prompt_token_ids), "completion_tokens": len(ids),
                   "cached_tokens": r.cached_tokens, "preemptions": r.preemptions, **latency_metrics(r.arrival_time, r.token_times, r.finish_time)}
        return RequestOutput(r.request_id, r.prompt_token_ids, list(ids), self.tokenizer.decode(text_ids),
                             r.finish_reason or "abort", r.error, metrics)
