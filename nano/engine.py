"""The continuous-batching engine: requests in, one model step at a time, tokens out.

Each `step()`:
  1. schedule — every running request that is decoding adds its one token; then requests that are mid-prefill
     and newly admitted ones add prompt chunks while the step's token budget lasts (chunked prefill);
  2. page     — each scheduled request gets pages for the tokens it adds; when the pool runs dry the most
     recently admitted request is preempted (pages freed, requeued at the front to recompute later);
  2b. check   — the integrity tracker compares the page tables about to be read with the (page, tag) pairs each
     request was given, in one batched check; a request that would read a page not its own is aborted (see
     nano/integrity.py);
  3. run      — one forward pass over all scheduled tokens (prefill chunks and decode tokens side by side);
  4. sample   — requests whose whole sequence is now cached sample their next token; finished ones free pages.

Scheduler invariants:
  * `running` is in admission order; a request is in exactly one of waiting / running / finished;
  * a request's `num_cached` tokens have KV in its pages, and the pages cover exactly those tokens;
  * a preempted request keeps the tokens it generated (recomputing them gives the same cache), so its final
    output equals an unconstrained run's.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from nano.errors import NanoError
from nano.integrity import make_tracker
from nano.model import ForwardBatch, Transformer
from nano.paging import KVPool, PageAllocator
from nano.sampling import SamplingParams, sample


@dataclass
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    max_total_tokens: int                      # prompt + output may not exceed this (the context)
    output_token_ids: list[int] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    expected_pages: list[int] = field(default_factory=list)    # what the allocator gave it, in order (integrity)
    expected_tags: list[int] = field(default_factory=list)     # each page's tag when it was given
    final_page_table: list[int] = field(default_factory=list)   # the pages it held when it finished (for /pages)
    final_page_tags: list[int] = field(default_factory=list)
    num_cached: int = 0                        # tokens whose KV is in the pages
    finish_reason: str | None = None           # "stop" | "length" | "abort"
    error: str | None = None
    keep_pages: bool = False                   # a prefill-only request keeps its pages after finishing, until
                                               # the transfer has read them (Engine.release)
    admitted: int = -1                         # admission order, for picking preemption victims
    preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    peak_running: int = 0
    peak_pages_used: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    step_s: float = 0.0        # wall time inside step()
    integrity_s: float = 0.0   # of which the integrity check


class Engine:
    def __init__(self, model: Transformer, pool: KVPool, eos_token_ids: set[int], *, max_running: int = 256,
                 max_step_tokens: int = 512, seed: int = 0, decode_kernel: bool = False,
                 integrity: bool = True) -> None:
        if max_running < 1 or max_step_tokens < 1:
            raise NanoError(f"max_running and max_step_tokens must be >= 1 (got {max_running}, {max_step_tokens})")
        self.model, self.pool, self.eos_token_ids = model, pool, eos_token_ids
        self.allocator = PageAllocator(pool.num_pages)
        self.integrity = make_tracker(integrity, pool.num_pages, pool.kv.device)
        self.max_running, self.max_step_tokens, self.seed = max_running, max_step_tokens, seed
        self.decode_kernel = decode_kernel
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._admissions = itertools.count()

    # ---- requests ----------------------------------------------------------------------------------------
    def add(self, prompt_token_ids: list[int], params: SamplingParams, max_total_tokens: int,
            keep_pages: bool = False) -> Request:
        request = self._new_request(prompt_token_ids, params, max_total_tokens)
        request.keep_pages = keep_pages
        self.waiting.append(request)
        return request

    def _new_request(self, prompt_token_ids: list[int], params: SamplingParams, max_total_tokens: int) -> Request:
        request_id = next(self._ids)
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + request_id
        return Request(request_id, list(prompt_token_ids), params, torch.Generator().manual_seed(seed),
                       max_total_tokens)

    def add_prefilled(self, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
                      max_total_tokens: int, write_kv: Callable[[list[int]], None]) -> Request | None:
        """Admit a request whose prompt KV was computed elsewhere (disaggregated prefill): give it pages for the
        prompt, let `write_kv(page_table)` fill them, and continue decoding from its first token. Returns None
        when the pool or `max_running` cannot take it now (try again after a step)."""
        need = self.pages_for(len(prompt_token_ids))
        if len(self.running) >= self.max_running or need > self.allocator.num_free:
            return None
        r = self._new_request(prompt_token_ids, params, max_total_tokens)
        r.page_table = self.allocator.allocate(need)
        self.integrity.on_allocate(r.page_table, r)
        write_kv(r.page_table)
        r.num_cached, r.admitted = len(prompt_token_ids), next(self._admissions)
        self.running.append(r)
        r.output_token_ids.append(first_token)
        r.token_times.append(time.perf_counter())
        self._finish_if_done(r, first_token)
        self.running = [q for q in self.running if not q.finished]
        return r

    def release(self, r: Request) -> None:
        """Free the pages a finished `keep_pages` request kept."""
        self._free(r)

    def set_integrity(self, enabled: bool) -> None:
        """Switch the integrity check on or off between runs (a benchmark comparing both on one engine)."""
        if self.has_work():
            raise NanoError("the integrity check can only be switched while no request is queued or running")
        self.integrity = make_tracker(enabled, self.pool.num_pages, self.pool.kv.device)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.page_size)

    # ---- one step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[tuple[Request, int | None]]:
        """Run one model step; returns (request, new token) for every request that sampled, and (request, None)
        for requests that ended without a token (aborted)."""
        events: list[tuple[Request, int | None]] = []
        started = time.perf_counter()
        try:
            return self._step(events)
        finally:
            self.stats.step_s += time.perf_counter() - started

    def _step(self, events: list[tuple[Request, int | None]]) -> list[tuple[Request, int | None]]:
        with record_function("schedule"):
            scheduled = self._schedule(events)
        if not scheduled:
            # with nothing running every page is free, so the oldest waiting request always fits
            assert events or not self.has_work(), "scheduler stalled"
            return events
        with record_function("schedule"):
            batch = self._batch(scheduled)
        # one batched check that every request reads exactly the pages (and allocations) it was given
        check_started = time.perf_counter()
        with record_function("integrity check"):
            flagged = self.integrity.check([r for r, _ in scheduled], batch)
        self.stats.integrity_s += time.perf_counter() - check_started
        if flagged:
            for i, error in flagged.items():
                self._abort(scheduled[i][0], error, events)
            scheduled = [s for i, s in enumerate(scheduled) if i not in flagged]
            if not scheduled:
                return events
            batch = self._batch(scheduled)
        ids, positions, last_rows, row = [], [], [], 0
        for r, n in scheduled:
            ids += r.token_ids[r.num_cached:r.num_cached + n]
            positions += range(r.num_cached, r.num_cached + n)
            row += n
            last_rows.append(row - 1)
        device = self.pool.kv.device
        self.model.phase.decode = all(n == 1 for _, n in scheduled)
        with record_function("forward"):
            logits = self.model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), batch,
                                torch.tensor(last_rows, device=device))
        self.stats.steps += 1
        ready = []
        for logit_row, (r, n) in enumerate(scheduled):
            r.num_cached += n
            if r.num_cached == r.num_tokens:  # the whole sequence is cached: its last row predicts the next token
                ready.append((r, logit_row))
            self.stats.decode_tokens += n if n == 1 else 0
            self.stats.prefill_tokens += n if n > 1 else 0
        if ready:
            with record_function("sampler"):
                tokens = sample(logits[[row for _, row in ready]], [r.params for r, _ in ready],
                                [r.generator for r, _ in ready])
            now = time.perf_counter()
            for (r, _), token in zip(ready, tokens):
                r.output_token_ids.append(token)
                r.token_times.append(now)
                self._finish_if_done(r, token)
                events.append((r, token))
        self.running = [r for r in self.running if not r.finished]
        return events

    def _batch(self, scheduled: list[tuple[Request, int]]) -> ForwardBatch:
        seqs = [(r.page_table, r.num_cached, n) for r, n in scheduled]
        return ForwardBatch.build(self.pool, seqs, self.pool.kv.device, self.decode_kernel)

    def _schedule(self, events: list[tuple[Request, int | None]]) -> list[tuple[Request, int]]:
        """Pick (request, tokens to add) for this step and give them pages, preempting when the pool is full."""
        budget = self.max_step_tokens
        scheduled: list[tuple[Request, int]] = []
        # decode first: every running request whose sequence is cached but for its newest token; then the
        # running requests that are mid-prefill, oldest first. Either may preempt the newest request.
        decoding = [r for r in self.running if r.num_tokens - r.num_cached == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_cached > 1]
        for r in decoding + prefilling:
            n = 1 if r in decoding else min(r.num_tokens - r.num_cached, budget)
            if n <= 0 or r not in self.running or not self._reserve(r, n, events):
                continue
            scheduled.append((r, n))
            budget -= n
        scheduled = [(r, n) for r, n in scheduled if r in self.running]  # drop requests preempted meanwhile
        # then admissions from the waiting queue, while the budget, max_running and free pages allow
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            r = self.waiting[0]
            if self.pages_for(min(r.num_tokens + 1, r.max_total_tokens)) > self.pool.num_pages:
                self.waiting.popleft()
                self._abort(r, f"request {r.request_id} needs {self.pages_for(r.num_tokens + 1)} KV pages but the "
                               f"pool holds {self.pool.num_pages} ({self.pool.tokens} tokens)", events)
                continue
            n = min(r.num_tokens - r.num_cached, budget)
            if not self._reserve(r, n, events, preempt=False):
                break  # the pool is full: wait for running requests to finish
            self.waiting.popleft()
            r.admitted = next(self._admissions)
            self.running.append(r)
            scheduled.append((r, n))
            budget -= n
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        self.stats.peak_pages_used = max(self.stats.peak_pages_used,
                                         self.pool.num_pages - self.allocator.num_free)
        return scheduled

    def _reserve(self, r: Request, n: int, events: list[tuple[Request, int | None]], preempt: bool = True) -> bool:
        """Make r's pages cover num_cached + n tokens. Decodes may preempt the most recently admitted request
        (r itself if it is the newest); returns False if r could not be given the pages."""
        need = self.pages_for(r.num_cached + n) - len(r.page_table)
        while need > self.allocator.num_free:
            if not preempt:
                return False
            victim = max(self.running, key=lambda q: q.admitted)
            if victim is r and len(self.running) == 1:
                self._abort(r, f"request {r.request_id} ran out of KV pages: it needs more than the whole pool "
                               f"({self.pool.tokens} tokens)", events)
                return False
            self._preempt(victim)
            if victim is r:
                return False
        pages = self.allocator.allocate(need) or []
        self.integrity.on_allocate(pages, r)
        r.page_table += pages
        return True

    def abort(self, r: Request, error: str) -> None:
        """End a request that its caller gave up on (e.g. a stream closed early), freeing its pages."""
        if r.finished:
            return
        if r in self.waiting:
            self.waiting.remove(r)
        self._abort(r, error, [])

    def _preempt(self, r: Request) -> None:
        self._free(r)
        r.num_cached, r.admitted = 0, -1
        r.preemptions += 1
        self.stats.preemptions += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    def _abort(self, r: Request, error: str, events: list[tuple[Request, int | None]]) -> None:
        r.finish_reason, r.error, r.finish_time = "abort", error, time.perf_counter()
        self._free(r)
        if r in self.running:
            self.running.remove(r)
        events.append((r, None))

    def _free(self, r: Request) -> None:
        """Give back the pages r owns (with integrity on: the ones still carrying the tags r was given)."""
        self.allocator.release(self.integrity.owned_pages(r))
        r.page_table, r.expected_pages, r.expected_tags = [], [], []

    def _finish_if_done(self, r: Request, token: int) -> None:
        p = r.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            r.finish_reason = "stop"
        elif len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= r.max_total_tokens:
            r.finish_reason = "length"
        if r.finished:
            r.finish_time = time.perf_counter()
            r.final_page_table, r.final_page_tags = r.page_table, r.expected_tags
            if not r.keep_pages:
                self._free(r)

    # ---- teacher forcing ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] of every position, through the same pages and chunked prefill as generation."""
        pages = self.allocator.allocate(self.pages_for(len(token_ids)))
        if pages is None:
            raise NanoError(f"scoring {len(token_ids)} tokens needs {self.pages_for(len(token_ids))} KV pages; "
                            f"{self.allocator.num_free} of {self.pool.num_pages} are free")
        self.integrity.on_allocate(pages)
        self.model.phase.decode = False   # teacher forcing is prefill: it runs the prefill weights
        try:
            device, rows = self.pool.kv.device, []
            for start in range(0, len(token_ids), self.max_step_tokens):
                chunk = token_ids[start:start + self.max_step_tokens]
                batch = ForwardBatch.build(self.pool, [(pages, start, len(chunk))], device)
                rows.append(self.model(torch.tensor(chunk, device=device),
                                       torch.arange(start, start + len(chunk), device=device), batch))
            return torch.cat(rows)
        finally:
            self.allocator.release(pages)
