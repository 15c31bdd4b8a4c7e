"""Sampling parameters and the sampler that turns a step's logits into next tokens.

The parameters need no torch, and the sampler imports it only when it runs: the command line checks the sampling
flags before torch loads."""
from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nano.errors import NanoError

if TYPE_CHECKING:
    import torch

MIN_TEMPERATURE = 1e-5   # the smallest temperature that samples; below it, 0 (greedy) says what is meant


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy, else >= MIN_TEMPERATURE
    top_k: int = 0                    # 0 = no top-k cut
    top_p: float = 1.0                # nucleus mass in (0, 1]
    seed: int | None = None           # per-request RNG seed in [0, 2**64); None = derived from the LLM's seed
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            raise NanoError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                            f"got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise NanoError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise NanoError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise NanoError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise NanoError(f"seed must be an integer in [0, 2**64), got {self.seed}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise NanoError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def seeded(self) -> SamplingParams:
        """These params for one reply a person asked for (nano chat, nano serve): their seed, or a fresh one from
        the OS when none is set, so that unseeded replies differ run after run. Left unset, the engine derives the
        seed from its own and the request's number, the same in every run: what bench, fault and eval rely on."""
        return self if self.seed is not None else dataclasses.replace(self, seed=secrets.randbits(64))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
           ) -> list[int | Exception]:
    """logits [B, vocab] fp32, one row per request -> one token id per request, or the exception its draw raised
    (the engine ends that request alone; the other rows keep their tokens).

    Greedy rows take the argmax. The others draw with the request's own generator (so a seeded request gives the
    same tokens whatever else runs beside it) from `distribution`."""
    import torch
    tokens: list[int | Exception] = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            try:
                tokens[row] = int(torch.multinomial(distribution(logits[row], p).cpu(), 1, generator=gen).item())
            except Exception as error:   # any failure here is this row's alone: its request ends with it
                tokens[row] = error
    return tokens


def distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [vocab] -> the probabilities [vocab] to draw from: divided by the temperature, cut to the top_k largest
    and to the smallest set whose probability reaches top_p. The row's maximum is subtracted first, so the scaled
    logits are <= 0 with the top one exactly 0 (no overflow whatever the temperature), and the top token always
    stays (a tiny top_p rounds to 0 in float32)."""
    scaled = (logits - logits.max()) / float(p.temperature)   # float: an int of 10**30 overflows torch's int64
    if p.top_k:
        kth = scaled.topk(min(p.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p   # the mass before a token already reaches top_p
        drop[0] = False
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs
