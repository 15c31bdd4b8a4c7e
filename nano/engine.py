"""The continuous-batching engine: requests in, one model step at a time, tokens out.

Each `step()`:
  1. schedule — the scheduler picks each request's tokens for this step and gives them pages, preempting when
     the pool is full (nano/scheduler.py);
  2. check    — the integrity tracker compares the page tables about to be read with the (page, tag) pairs each
     request was given, in one batched check; a request that would read a page not its own is aborted
     (nano/integrity.py);
  3. forward  — one forward pass over all scheduled tokens (prefill chunks and decode tokens side by side). When
     prefill and decode keep different weights, decode tokens and prefill chunks run as two passes, so every
     token goes through its own phase's weights whatever runs beside it;
  4. sample   — pages the pass filled go into the prefix cache; requests whose whole sequence is now cached
     sample their next token; finished ones drop their page references (cached pages stay, evictable). A request
     whose draw or ending raises is aborted alone, with the error; a failed forward pass raises out of step().
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from nano.batch import ForwardBatch, SequenceStep
from nano.errors import NanoError, brief
from nano.integrity import make_tracker
from nano.kv import KVPool
from nano.model import Transformer
from nano.sampling import SamplingParams, sample
from nano.scheduler import Events, Request, Scheduler
from nano.settings import EngineConfig


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    step_s: float = 0.0        # wall time inside step()
    integrity_s: float = 0.0   # of which the integrity check


class Engine:
    def __init__(self, model: Transformer, pool: KVPool, eos_token_ids: set[int], config: EngineConfig | None = None,
                 *, use_kernels: bool = False, peers: Any = None, **settings: Any) -> None:
        """`config`'s max_running, max_step_tokens, seed, integrity, prefix_cache and phase weights apply here;
        keyword `settings` change single fields (`Engine(model, pool, eos, max_running=8)`). `use_kernels`: the
        Triton GPU paths; `peers`: under tensor parallelism, the other ranks (nano.parallel.Peers), which run
        every pass this engine runs."""
        config = (config or EngineConfig()).replace(**settings)
        config.check()
        self.model, self.pool, self.eos_token_ids = model, pool, eos_token_ids
        self.integrity = make_tracker(config.integrity, pool)
        self.phase_weights = len(set(config.phase_weights)) > 1   # prefill and decode hold different weights
        self.scheduler = Scheduler(pool.num_pages, pool.page_size, self.integrity, max_running=config.max_running,
                                   max_step_tokens=config.max_step_tokens, prefix_cache=config.prefix_cache,
                                   cache_generated=not self.phase_weights)
        self.max_step_tokens, self.seed = config.max_step_tokens, config.seed
        self.use_kernels, self.peers = use_kernels, peers
        self.stats = EngineStats()
        self._ids = itertools.count()

    # ---- requests ----------------------------------------------------------------------------------------
    def add(self, prompt_token_ids: list[int], params: SamplingParams, max_total_tokens: int,
            keep_pages: bool = False) -> Request:
        request = self._new_request(prompt_token_ids, params, max_total_tokens)
        request.keep_pages = keep_pages
        self.scheduler.waiting.append(request)
        return request

    def _new_request(self, prompt_token_ids: list[int], params: SamplingParams, max_total_tokens: int) -> Request:
        request_id = next(self._ids)
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + request_id) % 2**64
        return Request(request_id, list(prompt_token_ids), params, torch.Generator().manual_seed(seed),
                       max_total_tokens)

    def add_prefilled(self, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
                      max_total_tokens: int, parts: dict[str, torch.Tensor],
                      generator_state: torch.Tensor | None = None) -> Request | None:
        """Admit a request whose prompt KV was computed elsewhere (disaggregated prefill): give it pages for the
        prompt, write `parts` (KVPool.export_tokens of the other pool) into them through `import_kv`, and continue
        decoding from its first token with the sampler state the first token left (`generator_state`). Returns
        None when the pool or `max_running` cannot take it now (try again after a step)."""
        r = self._new_request(prompt_token_ids, params, max_total_tokens)
        r.num_cached = len(prompt_token_ids)
        if not self.scheduler.admit_prefilled(r):
            return None
        if generator_state is not None:
            r.generator.set_state(generator_state)
        self.import_kv(r.page_table, r.expected_tags, parts)
        self._append_token(r, first_token)
        self.scheduler.retire()
        return r

    def export_kv(self, r: Request, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """A finished `keep_pages` request's prompt KV, token-major (KVPool.export_tokens, into `out` if given),
        after the integrity check that its page table is exactly what it was given."""
        error = self.integrity.verify(r)
        if error:
            raise NanoError(error)
        return self.pool.export_tokens(r.page_table, len(r.prompt_token_ids), out)

    def import_kv(self, pages: list[int], page_tags: list[int], parts: dict[str, torch.Tensor]) -> None:
        """Write a prompt's KV computed elsewhere (KVPool.import_tokens) into `pages`, the writer presenting the tag
        each page had when it was given them: refused when any page has been given to someone since (a late
        write), so it cannot land in another request's KV."""
        if not self.integrity.verify_pages(pages, page_tags):
            raise NanoError(f"KV integrity: a write into pages {pages} was refused: they are no longer the writer's "
                            f"(a late write)")
        self.pool.import_tokens(pages, parts)

    def release(self, r: Request) -> None:
        """Free the pages a finished `keep_pages` request kept."""
        self.scheduler.release(r)

    def abort(self, r: Request, error: str) -> None:
        """End a request that its caller gave up on (e.g. a stream closed early), freeing its pages."""
        self.scheduler.end(r, error, [])

    def set_integrity(self, enabled: bool) -> None:
        """Switch the integrity check on or off between runs (a benchmark comparing both on one engine)."""
        if self.has_work() or self.scheduler.kept:
            raise NanoError("the integrity check can only be switched while no request is queued or running")
        self.integrity = self.scheduler.tracker = make_tracker(enabled, self.pool)
        self.scheduler.allocator.clear_cache()   # its entries carry the old tracker's tags

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def counters(self) -> dict[str, Any]:
        """Engine and scheduler counters (with the prefix cache's: tokens looked up, found, stale entries refused),
        the unreferenced pages (free or cached) and the cached ones, the allocator's double frees and the integrity
        counts."""
        tracker, allocator = self.integrity, self.scheduler.allocator
        return {**dataclasses.asdict(self.stats), **dataclasses.asdict(self.scheduler.stats),
                "prefix_cache": self.scheduler.prefix_cache, "cached_pages": len(allocator.cache),
                "free_pages": allocator.num_free, "double_frees": allocator.double_frees, "integrity": tracker.enabled,
                "checked": tracker.checked, "mismatched": tracker.mismatched, "aborted": tracker.aborted}

    def reset_counters(self) -> None:
        self.stats = EngineStats()
        self.scheduler.stats = type(self.scheduler.stats)()
        self.scheduler.allocator.double_frees = 0
        self.integrity.reset_counters()

    # ---- one step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> Events:
        """Run one model step; returns (request, new token) for every request that sampled, and (request, None)
        for requests that ended without a token (aborted)."""
        events: Events = []
        started = time.perf_counter()
        try:
            with record_function("schedule"):
                scheduled = self.scheduler.schedule(events)
            # with nothing running every page is free, so the oldest waiting request always fits
            assert scheduled or events or not self.has_work(), "scheduler stalled"
            passes = [scheduled]
            if self.phase_weights:   # each token through its own phase's weights: decodes and chunks apart
                passes = [[s for s in scheduled if s[1] == 1], [s for s in scheduled if s[1] > 1]]
            for part in passes:
                if part:
                    self._forward(part, events)
            self.stats.steps += bool(scheduled)
            self.scheduler.retire()
            return events
        finally:
            self.stats.step_s += time.perf_counter() - started

    def _check(self, part: list[tuple[Request, int]], events: Events) -> list[tuple[Request, int]]:
        """One batched check that every request of the pass holds exactly the pages (and page allocations) it was
        given; flagged requests are aborted and left out."""
        started = time.perf_counter()
        with record_function("integrity check"):
            flagged = self.integrity.check([r for r, _ in part])
        self.stats.integrity_s += time.perf_counter() - started
        for i, error in flagged.items():
            self.scheduler.end(part[i][0], error, events)
        return [s for i, s in enumerate(part) if i not in flagged]

    def _sequence(self, r: Request, num_new: int) -> SequenceStep:
        """r's part of a pass: its page table, as the integrity check has just compared it with r's records."""
        return SequenceStep(r.page_table, r.num_cached, num_new)

    def _run(self, seqs: list[SequenceStep], batch: ForwardBatch, ids: torch.Tensor, positions: torch.Tensor,
             logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The model's forward pass; under tensor parallelism the other ranks get the same pass first."""
        if self.peers is None:
            return self.model(ids, positions, batch, logits_rows)
        return self.peers.run_pass(self.model, seqs, batch, ids, positions, logits_rows)

    def _forward(self, part: list[tuple[Request, int]], events: Events) -> None:
        part = self._check(part, events)
        if not part:
            return
        with record_function("schedule"):
            seqs = [self._sequence(r, n) for r, n in part]
            batch = ForwardBatch.build(self.pool, seqs, self.pool.kv.device, decode=all(n == 1 for _, n in part),
                                       use_kernels=self.use_kernels)
        ids, positions, last_rows, row = [], [], [], 0
        for r, n in part:
            ids += r.tokens(r.num_cached, r.num_cached + n)
            positions += range(r.num_cached, r.num_cached + n)
            row += n
            last_rows.append(row - 1)
        device = self.pool.kv.device
        with record_function("forward"):
            logits = self._run(seqs, batch, torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                               torch.tensor(last_rows, device=device))
        ready = []
        for logit_row, (r, n) in enumerate(part):
            r.num_cached += n
            self.scheduler.cache_pages(r)
            if r.num_cached == r.num_tokens:  # the whole sequence is cached: its last row predicts the next token
                ready.append((r, logit_row))
            decoded = n == 1 and bool(r.output_token_ids)   # its newest generated token; anything else is prompt
            self.stats.decode_tokens += n if decoded else 0       # (or a recomputation after preemption)
            self.stats.prefill_tokens += 0 if decoded else n
        if not ready:
            return
        with record_function("sampler"):
            tokens = sample(logits[[row for _, row in ready]], [r.params for r, _ in ready],
                            [r.generator for r, _ in ready])
        for (r, _), token in zip(ready, tokens):
            try:   # a failure in one request's draw or ending ends that request; the others keep their tokens
                if isinstance(token, Exception):
                    raise token
                self._append_token(r, token)
                events.append((r, token))
            except Exception as error:
                self.scheduler.end(r, f"request {r.request_id} failed: {type(error).__name__}: {brief(error)}", events)

    def _append_token(self, r: Request, token: int) -> None:
        r.output_token_ids.append(token)
        r.token_times.append(time.perf_counter())
        p = r.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self.scheduler.finish(r, "stop")
        elif len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= r.max_total_tokens:
            self.scheduler.finish(r, "length")

    # ---- teacher forcing ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] of every position, through the same pages, chunked prefill and integrity check as
        generation (each chunk reads the pages of the chunks before it)."""
        scoring = self._new_request(token_ids, SamplingParams(), len(token_ids))
        need = self.scheduler.pages_for(len(token_ids))
        pages = self.scheduler.allocator.allocate(need)
        if pages is None:
            raise NanoError(f"scoring {len(token_ids)} tokens needs {need} KV pages; "
                            f"{self.scheduler.allocator.num_free} of {self.pool.num_pages} are free")
        scoring.page_table = pages
        self.integrity.on_allocate(pages, scoring)
        try:
            device, rows = self.pool.kv.device, []
            for start in range(0, len(token_ids), self.max_step_tokens):
                chunk = token_ids[start:start + self.max_step_tokens]
                flagged = self.integrity.check([scoring])
                if flagged:
                    raise NanoError(flagged[0])
                scoring.num_cached = start
                seqs = [self._sequence(scoring, len(chunk))]
                batch = ForwardBatch.build(self.pool, seqs, device)
                rows.append(self._run(seqs, batch, torch.tensor(chunk, device=device),
                                      torch.arange(start, start + len(chunk), device=device)))
            return torch.cat(rows)
        finally:
            self.scheduler.allocator.release(self.integrity.owned_pages(scoring))
