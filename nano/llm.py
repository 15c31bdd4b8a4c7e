"""`LLM`: the Python API — load a model, then generate, stream or score.

Data flows one way: a prompt becomes an engine `Request`; the engine's scheduler batches it with the others
(continuous batching over the paged KV pool); the model runner computes each step; the sampler picks tokens;
finished requests become `RequestOutput`s.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nano.config import ModelConfig
from nano.engine import Engine, EngineConfig
from nano.errors import NanoError, brief
from nano.kernels import require_triton, triton_available
from nano.loader import Resolved, load_weights, read_config, resolve_model
from nano.kv import KVPool
from nano import parallel
from nano.model import Transformer
from nano.quant import convert_weights, unquantized_modules, weight_bytes_by_format
from nano.sampling import SamplingParams
from nano.scheduler import Request, latency_metrics
from nano.settings import DTYPES, default_dtype, usable_cores
from nano.tokenizer import TextStream, Tokenizer, load_tokenizer, utf8_text

@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None     # "stop" | "length" | "abort"; None while it runs (LLM.stream)
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


def encode_request(prompt: str | list[int], params: SamplingParams, name: str, tokenizer: Tokenizer,
                   config: ModelConfig, max_request_tokens: int) -> tuple[list[int], int]:
    """The prompt's token ids and the most tokens its request may hold (prompt + output, cut at the context), refused
    up front (check_request_fits) when that is more than the KV pool holds (`max_request_tokens`): it would fail once
    it outgrew the pool."""
    ids = encode_prompt(prompt, name, tokenizer, config)
    context = config.max_position_embeddings
    max_tokens = min(params.max_tokens, context - len(ids))       # the reply stops at the context
    try:
        check_request_fits(len(ids), max_tokens, max_request_tokens, context, name=name)
    except NanoError as error:
        room = max_request_tokens - len(ids)
        raise NanoError(f"{error}: use {f'max_tokens {room} or less' if room > 0 else 'a shorter prompt'} or a "
                        "bigger --kv-budget") from None
    return ids, len(ids) + max_tokens


def check_request_fits(prompt_tokens: int, max_tokens: int | None, limit: int, context: int,
                       at_least: bool = False, name: str = "the prompt") -> None:
    """A NanoError unless a prompt of `prompt_tokens` tokens (or at least that many) and `max_tokens` (one token when
    not given) fit the `limit` of one request (`max_request_tokens`: the model's `context`, or the KV pool if
    smaller). The server and nano chat refuse such a request up front, where `LLM.generate` cuts its reply at the
    context: a user who asked for more tokens than can come learns it before waiting for the reply."""
    if prompt_tokens + (max_tokens or 1) <= limit:
        return
    prompt = f"{name} ({'at least ' if at_least else ''}{prompt_tokens} tokens)"
    asked = f"{prompt} + max_tokens ({max_tokens})" if max_tokens else f"{prompt} + one output token"
    holds = f"the model's context ({context} tokens)" if limit >= context else f"the KV pool holds ({limit} tokens)"
    raise NanoError(f"{asked} is more than {holds}")


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a model's matmuls run in. A CPU without a bfloat16 matmul unit (no AVX512-BF16, no AMX) gets
    PyTorch's bf16 GEMM 6-8x slower than its fp32 one (measured on this project's AVX2 machine, docs/bench.md),
    so there a bfloat16 model holds its bf16 weight values in float32 (exactly: every bf16 is a float32) and
    computes in float32. What stays bfloat16: the KV pages (kv_dtype auto), the INT4 kernel's activations."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")     # torch.cpu's (private) CPU feature checks
    native = device.type != "cpu" or any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return torch.float32 if dtype == torch.bfloat16 and not native else dtype


def text_stream(tokenizer: Tokenizer, config: ModelConfig, params: SamplingParams, stop: Sequence[str] = ()
                ) -> TextStream:
    """The TextStream of one request's reply: its end tokens (the stop token ids; the model's end-of-turn ids
    unless `ignore_eos`) and every special token are not text; `stop` strings cut it."""
    eos = set() if params.ignore_eos else set(tokenizer.eos_token_ids) | set(config.eos_token_ids)
    return TextStream(tokenizer, eos | set(params.stop_token_ids), stop)


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


@functools.cache
def process_threads() -> int:
    """`default_threads()` as this process's first engine found it; later engines keep it, so that configurations
    built one after another in one process (bench --compare and --sweep-concurrency, --reproduce-blog, eval) run
    with the same count, whatever load the earlier runs left in the load average (measured here: a sweep whose
    first engine got 2 threads and its second 1 showed BF16 KV at 0.45x FP8's speed before either pool was full)."""
    return default_threads()


class LLM:
    def __init__(self, model: str, config: EngineConfig | None = None, *, progress: bool = True,
                 **settings: Any) -> None:
        """`config`: the engine's settings (nano.engine.EngineConfig); keyword `settings` change single fields of
        it (`LLM("glm-5.2-random", kv_dtype="fp8")`). `progress`: a progress bar while a checkpoint loads.
        With `tp` > 1 the model is split over that many ranks (nano/parallel.py): this process is rank 0 and starts
        the others, unless a launcher (torchrun) started every rank, in which case ranks other than 0 call
        `serve()`."""
        self.engine_config = config = (config or EngineConfig()).replace(**settings)
        config.check()
        torch.set_num_threads(config.threads or process_threads())
        resolved, self.config = resolve_config(model, config.weights_dir)
        config.check_fits(self.config)
        # the other ranks build the same LLM from these (JSON: plain values only)
        self.group = parallel.join(config.tp, dict(model=model, **dataclasses.asdict(config)), self.config)
        with parallel.stopped_on_error(self.group):   # a rank 0 that fails to build leaves no ranks behind
            self.rank = 0 if self.group is None else self.group.rank
            self.device = self.group.device if self.group else config.torch_device
            self.dtype, self.seed = getattr(torch, DTYPES[config.dtype or default_dtype(self.device)]), config.seed
            self._load(resolved, config, progress and self.rank == 0)
            self.pool = KVPool.from_budget(self.config, config.resolved_kv_dtype, config.kv_budget_bytes,
                                           config.page_size, self.device, config.kv_layout)
            self.max_request_tokens = min(self.max_context, self.pool.tokens)   # prompt + output, at most
            self.use_kernels = self._use_kernels(config.decode_kernel)
            self.last_request: Request | None = None
            eos = set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids)
            self.engine = Engine(self.model, self.pool, eos, config, use_kernels=self.use_kernels,
                                 peers=parallel.Peers(self.group) if self.group and self.rank == 0 else None)

    def _load(self, resolved: Resolved, config: EngineConfig, progress: bool) -> None:
        """The model's weights (drawn for a stand-in, read for a checkpoint: this rank's part), in each phase's
        format, held in the compute dtype; and its tokenizer."""
        # a checkpoint's weights are allocated as they are read, each in the format the checkpoint stores
        self.model = Transformer(self.config, self.dtype, self.device, materialize=resolved.kind == "nano")
        if resolved.kind == "nano":
            self.model.init_random(config.seed)   # the whole model, then this rank's part: any tp draws the same
        sharding = None if self.group is None else parallel.shard(self.model, self.group)
        if resolved.kind != "nano":
            load_weights(self.model, resolved.path, self.config, progress=progress, sharding=sharding)
        # one format for both phases, or prefill and decode each their own (e.g. FP8 prefill, INT4 decode)
        self.prefill_weights, self.decode_weights = config.phase_weights
        convert_weights(self.model, self.prefill_weights, self.decode_weights, self.dtype, config.int4_all,
                        config.int4_group_size, keep=unquantized_modules(self.config.quantization_config))
        self.compute_dtype = compute_dtype(self.dtype, self.device)
        self.model.hold_weights_in(self.compute_dtype)
        self.tokenizer = load_tokenizer(resolved.path, self.config)
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise NanoError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                            f"{self.config.vocab_size}: tokenizer and weights do not belong together")
        self.label = resolved.label
        self.max_context = self.config.max_position_embeddings

    def _use_kernels(self, decode_kernel: str) -> bool:
        """Whether decode runs the Triton MLA kernel: asked for (`triton`), or `auto` on a GPU where it fits."""
        fits = all(d >= 16 and d & (d - 1) == 0 for d in (self.config.kv_lora_rank, self.config.qk_rope_head_dim))
        if decode_kernel == "triton":
            require_triton("decode_kernel='triton'")
            if not triton_available():
                raise NanoError("decode_kernel='triton' needs triton and a GPU (or TRITON_INTERPRET=1 for testing)")
            if not fits:
                raise NanoError(f"the Triton MLA kernel needs kv_lora_rank and qk_rope_head_dim to be powers of two "
                                f">= 16 (this model: {self.config.kv_lora_rank}, {self.config.qk_rope_head_dim})")
        return decode_kernel == "triton" or (decode_kernel == "auto" and self.device.type == "cuda"
                                             and triton_available() and fits)

    # ---- public API ---------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Ranks other than 0 of a tensor-parallel LLM: run the passes rank 0 sends until it stops."""
        if self.group is None or self.rank == 0:
            raise NanoError("serve() is for ranks other than 0 of a tensor-parallel LLM")
        parallel.serve(self.model, self.pool, self.group, self.use_kernels)

    def health(self) -> str | None:
        """None while every rank this LLM depends on is alive (always, on a single device), else a one-line reason."""
        return None if self.group is None else self.group.health()

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
        checked = [encode_request(p, params, name, self.tokenizer, self.config, self.max_request_tokens)
                   for p, name in zip(prompts, names)]   # all, before any runs
        requests = [self.engine.add(ids, params, total) for ids, total in checked]
        while not all(r.finished for r in requests):
            self.poll()
        return [self.output(r) for r in requests]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """The request as it runs: a RequestOutput after each new token (its `token_ids` and `text` so far,
        `finish_reason` None), and the finished one last. `llm.last_request` is the engine's record of it (page
        table, timings)."""
        params = params or SamplingParams()
        request = self.last_request = self.submit(prompt, params)
        text = text_stream(self.tokenizer, self.config, params)
        try:
            while not request.finished:
                for r, token in self.engine.step():
                    if r is request and token is not None and not request.finished \
                            and self._add_text(request, text, [token]) is None:
                        yield RequestOutput(request.request_id, request.prompt_token_ids,
                                            list(request.output_token_ids), text.text, None)
        finally:  # also when the caller stops early (Ctrl-C, break): the request must not keep its pages
            self.engine.abort(request, "the stream was closed before the request finished")
        yield self.output(request)

    def submit(self, prompt: str | list[int], params: SamplingParams, name: str = "prompt") -> Request:
        """Queue one prompt; `poll()` advances it. The request's fields say where it is (finished, output token
        ids, token_times); `SplitLLM` has the same submit/poll pair. Refused (NanoError) when the prompt and
        max_tokens can never fit the KV pool."""
        ids, total = encode_request(prompt, params, name, self.tokenizer, self.config, self.max_request_tokens)
        return self.engine.add(ids, params, total)

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
        figures = {**self.engine.counters(), "kv_dtype": pool.kv_dtype, "kv_layout": pool.kv_layout,
                   "num_pages": pool.num_pages,
                   "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                   "page_size": pool.page_size, "kv_tokens": pool.tokens, "kv_bytes": pool.nbytes}
        if reset:
            self.engine.reset_counters()
        return figures

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [T, vocab] (fp32): the tokens go through the same pages and chunked prefill as
        generation, so row t is the distribution of token t + 1."""
        return self.engine.score(encode_prompt(token_ids, "token_ids", self.tokenizer, self.config))

    # ---- requests ----------------------------------------------------------------------------------------
    def _add_text(self, r: Request, text: TextStream, tokens: list[int], final: bool = False) -> str | None:
        """Add r's `tokens` to its text (and finish it); if that fails (a token the tokenizer cannot decode), r ends
        with the reason, which is returned: the caller's loop goes on."""
        try:
            text.add(tokens)
            if final:
                text.finish()
            return None
        except Exception as error:   # the tokenizer's failure is this request's alone
            reason = f"request {r.request_id}'s tokens could not be turned into text: {brief(error)}"
            self.engine.abort(r, reason)
            return reason

    def output(self, r: Request) -> RequestOutput:
        """An engine request as a RequestOutput: its text (without the special tokens, such as the one that ended
        it, which its token ids keep), its finish reason and metrics (the split's decode worker reports its requests
        with it)."""
        ids = r.output_token_ids
        text = text_stream(self.tokenizer, self.config, r.params)
        failed = self._add_text(r, text, ids, final=True)
        metrics = {"prompt_tokens": len(r.prompt_token_ids), "completion_tokens": len(ids),
                   "cached_tokens": r.cached_tokens, "preemptions": r.preemptions,
                   **latency_metrics(r.arrival_time, r.token_times, r.finish_time)}
        return RequestOutput(r.request_id, r.prompt_token_ids, list(ids), text.text,
                             "abort" if failed else r.finish_reason or "abort", failed or r.error, metrics)
