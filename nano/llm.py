"""`LLM`: the Python API — load a model, then generate, stream or score.

Data flows one way: a prompt becomes a `Request`; the step loop prefills it (in chunks of at most
`max_prefill_tokens`), then decodes every running request together, one token per step; the sampler picks each
next token; finished requests become `RequestOutput`s.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from nano.config import ModelConfig
from nano.errors import NanoError
from nano.kvcache import ContiguousKV
from nano.loader import load_weights, read_config, resolve_model
from nano.model import SeqSlice, Transformer
from nano.sampling import SamplingParams, sample
from nano.tokenizer import load_tokenizer

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


@dataclass
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    kv: ContiguousKV
    capacity: int                                   # prompt + output tokens this request may reach
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class LLM:
    def __init__(self, model: str, *, weights: str | None = None, dtype: str | None = None,
                 device: str | None = None, seed: int = 0, max_prefill_tokens: int = 512,
                 progress: bool = True) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        if dtype not in DTYPES:
            raise NanoError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if max_prefill_tokens < 1:
            raise NanoError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.dtype, self.seed, self.max_prefill_tokens = DTYPES[dtype], seed, max_prefill_tokens
        resolved = resolve_model(model, weights)
        raw = resolved.preset.nano_config if resolved.kind == "nano" else read_config(resolved.path)
        self.config: ModelConfig = ModelConfig.from_hf(raw)
        self.model = Transformer(self.config, self.dtype, self.device)
        if resolved.kind == "nano":
            self.model.init_random(seed)
        else:
            load_weights(self.model, resolved.path, self.config, progress=progress)
        self.tokenizer = load_tokenizer(resolved.path if resolved.kind == "checkpoint" else None, self.config)
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise NanoError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                            f"{self.config.vocab_size}: tokenizer and weights do not belong together")
        self.label = resolved.label
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids)
        self.max_context = self.config.max_position_embeddings
        self._request_ids = itertools.count()

    # ---- public API ---------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | list[int]], params: SamplingParams | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion (decoding them together) and return outputs in prompt order."""
        params = params or SamplingParams()
        names = [f"prompt {i}" if len(prompts) > 1 else "prompt" for i in range(len(prompts))]
        requests = [self._make_request(self._prompt_ids(p, name), params) for p, name in zip(prompts, names)]
        for _ in self._run(requests):
            pass
        return [self._output(r) for r in requests]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[int]:
        """Yield the generated token ids of one prompt as they are produced. Once the stream is exhausted,
        `llm.last_output` holds its RequestOutput (finish reason, text, metrics)."""
        request = self._make_request(self._prompt_ids(prompt, "prompt"), params or SamplingParams())
        for _, token in self._run([request]):
            yield token
        self.last_output = self._output(request)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [T, vocab] (fp32): the prompt goes through the same chunked prefill and
        latent cache as generation, so row t is the distribution of token t + 1."""
        ids = self._prompt_ids(token_ids, "token_ids")
        kv = ContiguousKV(self.config, len(ids), self.dtype, self.device)
        rows = [self._forward([(kv, ids[start:start + self.max_prefill_tokens], start)], all_rows=True)
                for start in range(0, len(ids), self.max_prefill_tokens)]
        return torch.cat(rows)

    # ---- requests ----------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int], name: str) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise NanoError(f"{name}: token id {bad[0]} is outside the vocabulary "
                                f"[0, {self.config.vocab_size})")
        else:
            raise NanoError(f"{name} must be a string or a list of token ids")
        if not ids:
            raise NanoError(f"{name} is empty")
        if len(ids) >= self.max_context:
            raise NanoError(f"{name} is {len(ids)} tokens but the model's context is {self.max_context} "
                            f"tokens (prompt + output)")
        return ids

    def _make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        request_id = next(self._request_ids)
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + request_id
        capacity = min(len(prompt_ids) + params.max_tokens, self.max_context)
        return Request(request_id, prompt_ids, params, torch.Generator().manual_seed(seed),
                       ContiguousKV(self.config, capacity, self.dtype, self.device), capacity)

    def _output(self, r: Request) -> RequestOutput:
        ids = r.output_token_ids
        text_ids = ids[:-1] if r.finish_reason == "stop" else ids  # the stop token is not part of the text
        metrics = {"prompt_tokens": len(r.prompt_token_ids), "completion_tokens": len(ids)}
        if r.token_times:
            metrics["ttft_s"] = r.token_times[0] - r.arrival_time
            metrics["e2e_s"] = r.token_times[-1] - r.arrival_time
            if len(ids) > 1:
                metrics["tpot_s"] = (r.token_times[-1] - r.token_times[0]) / (len(ids) - 1)
        return RequestOutput(r.request_id, r.prompt_token_ids, list(ids), self.tokenizer.decode(text_ids),
                             r.finish_reason or "abort", None, metrics)

    def _finish_if_done(self, r: Request, token: int) -> None:
        p = r.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            r.finish_reason = "stop"
        elif len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= r.capacity:
            r.finish_reason = "length"

    # ---- the step loop -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, requests: list[Request]) -> Iterator[tuple[Request, int]]:
        """Prefill each request, then decode all unfinished ones together; yields (request, new token)."""
        running: list[Request] = []
        for r in requests:
            prompt = r.prompt_token_ids
            for start in range(0, len(prompt), self.max_prefill_tokens):
                logits = self._forward([(r.kv, prompt[start:start + self.max_prefill_tokens], start)])
            yield r, self._accept(r, sample(logits, [r.params], [r.generator])[0])
            if r.finish_reason is None:
                running.append(r)
        while running:
            logits = self._forward([(r.kv, r.output_token_ids[-1:], r.num_tokens - 1) for r in running])
            tokens = sample(logits, [r.params for r in running], [r.generator for r in running])
            for r, token in zip(running, tokens):
                yield r, self._accept(r, token)
            running = [r for r in running if r.finish_reason is None]

    def _accept(self, r: Request, token: int) -> int:
        r.output_token_ids.append(token)
        r.token_times.append(time.perf_counter())
        self._finish_if_done(r, token)
        return token

    def _forward(self, chunks: list[tuple[ContiguousKV, list[int], int]], all_rows: bool = False) -> torch.Tensor:
        """One model step over several sequences: each chunk is (cache, new token ids, tokens already cached).
        Returns logits for every row (all_rows) or for each sequence's last row."""
        ids, positions, seqs, last_rows = [], [], [], []
        for kv, new_ids, past in chunks:
            seqs.append(SeqSlice(kv, len(ids), past, len(new_ids)))
            ids.extend(new_ids)
            positions.extend(range(past, past + len(new_ids)))
            last_rows.append(len(ids) - 1)
        to_device = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        return self.model(to_device(ids), to_device(positions), seqs, None if all_rows else to_device(last_rows))
