"""Sampling parameters and the sampler that turns a step's logits into next tokens."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nano.errors import NanoError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = no top-k cut
    top_p: float = 1.0                # nucleus mass in (0, 1]
    seed: int | None = None           # per-request RNG seed; None = derived from the LLM's seed
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise NanoError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise NanoError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise NanoError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise NanoError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise NanoError(f"seed must be an integer >= 0, got {self.seed}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise NanoError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits [B, vocab] fp32, one row per request -> one token id per request.

    Greedy rows take the argmax. The others divide by the temperature, keep the top_k largest logits and the
    smallest set whose probability reaches top_p, and draw from what is left with the request's own generator
    (so a seeded request gives the same tokens whatever else runs beside it)."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        scaled = logits[row] / p.temperature
        if p.top_k:
            kth = scaled.topk(min(p.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # drop a token when the mass before it already reaches top_p (the top token always stays)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        tokens[row] = int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
    return tokens
