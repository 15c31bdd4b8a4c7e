"""The scheduler: which requests run each step, how many tokens each adds, and the KV pages they hold.

Each step it picks (request, tokens to add) pairs:
  * decode first — every running request whose sequence is cached but for its newest token adds that token;
  * then prefill — running requests that are mid-prompt, oldest first, then newly admitted ones, add prompt
    chunks while the step's token budget lasts (chunked prefill). A newly admitted request first takes the
    longest prefix of its tokens that the prefix cache holds (whole pages, shared with whoever holds them) and
    prefills only the rest;
  * every chosen request gets pages for the tokens it adds; when the pool runs dry, cached pages nobody uses
    are evicted first, then the most recently admitted request is preempted (its references dropped, requeued
    at the front, recomputed later — from the cache, as far as its pages are still there).
After each pass, `cache_pages` puts a request's newly filled pages into the prefix cache.

Invariants (checked by `check`: in production whenever a step leaves the engine idle, after every step under
NANO_CHECK=1 and in the tests; a broken one raises `InvariantError`, naming it):
  * a request is in exactly one of waiting / running / finished; `running` is in admission order, and
    `r.admitted >= 0` exactly when r is running;
  * a waiting request holds no pages and has nothing cached;
  * a running request's pages cover exactly the tokens it has cached: ceil(num_cached / page_size) of them;
  * every page is free, cached and unreferenced, or referenced — and a page's refcount is the number of page
    tables (running requests, finished `keep_pages` ones not yet released) that hold it (PageAllocator.check);
  * a cached page holds the tokens its key says, for every request that holds it; with integrity on, its bytes
    are the ones it was cached with, checked when a request takes it (a checksum taken when it was cached, kept
    per page and read only for an entry whose tag still matches: one that left the cache is never read again);
  * a preempted request keeps the tokens it generated (recomputing them gives the same cache), so its final
    output equals an unconstrained run's.
"""
from __future__ import annotations

import itertools
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from nano.errors import NanoError
from nano.integrity import IntegrityTracker, NullTracker
from nano.kv import CachedPage, PageAllocator
from nano.sampling import SamplingParams

Events = list[tuple["Request", int | None]]   # (request, new token), or (request, None) for one that ended
# NANO_CHECK=1: check the invariants before every step, not only when the engine goes idle (Scheduler.retire)
CHECK_EVERY_STEP = os.environ.get("NANO_CHECK") == "1"


class InvariantError(NanoError):
    """A scheduler or allocator invariant does not hold: a bug in nano's page bookkeeping, not the caller's."""


@dataclass(eq=False, slots=True)
class Request:
    """One request's state in the engine. Identity equality: `r in running` compares references, not fields."""
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    max_total_tokens: int                      # prompt + output may not exceed this (the context)
    output_token_ids: list[int] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    page_keys: list[int] = field(default_factory=list)         # prefix-cache key of each full page, in order
    expected_pages: list[int] = field(default_factory=list)    # what the allocator gave it, in order (integrity)
    expected_tags: list[int] = field(default_factory=list)     # each page's tag when it was given
    num_cached: int = 0                        # tokens whose KV is in the pages
    finish_reason: str | None = None           # "stop" | "length" | "abort"
    error: str | None = None
    keep_pages: bool = False                   # a prefill-only request keeps its pages after finishing, until
                                               # the transfer has read them (Engine.release)
    admitted: int = -1                         # admission order while running (preemption victims), else -1
    preemptions: int = 0
    cached_tokens: int = 0                     # tokens taken from the prefix cache at its first admission
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] without building the whole sequence (a step needs a few of its newest tokens)."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt:stop - prompt]
        return self.prompt_token_ids[start:stop] + self.output_token_ids[:max(stop - prompt, 0)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def latency_metrics(arrival_time: float, token_times: list[float], finish_time: float | None) -> dict[str, float]:
    """The one definition of a request's latencies, in seconds: TTFT (arrival -> first token), TPOT (the mean gap
    between later tokens: (last - first) / (tokens - 1)), E2E (arrival -> end). Each only when it is defined."""
    metrics = {}
    if token_times:
        metrics["ttft_s"] = token_times[0] - arrival_time
    if len(token_times) > 1:
        metrics["tpot_s"] = (token_times[-1] - token_times[0]) / (len(token_times) - 1)
    if finish_time is not None:
        metrics["e2e_s"] = finish_time - arrival_time
    return metrics


@dataclass(slots=True)
class SchedulerStats:
    preemptions: int = 0
    peak_running: int = 0
    peak_pages_used: int = 0
    lookup_tokens: int = 0      # tokens of the sequences looked up in the prefix cache at admission
    cached_tokens: int = 0      # of which found there (not prefilled again)
    stale_entries: int = 0      # cache entries refused because their page was reallocated (integrity on)
    corrupt_entries: int = 0    # cache entries refused because their page's bytes changed since (integrity on)


class Scheduler:
    def __init__(self, num_pages: int, page_size: int, tracker: IntegrityTracker | NullTracker, *,
                 max_running: int, max_step_tokens: int, prefix_cache: bool = True,
                 cache_generated: bool = True) -> None:
        """`prefix_cache`: share full pages of token prefixes seen before; `cache_generated`: cache the pages of
        generated tokens too (False when decode keeps other weights than prefill: their KV would differ from a
        prefill's)."""
        self.num_pages, self.page_size, self.tracker = num_pages, page_size, tracker
        self.max_running, self.max_step_tokens = max_running, max_step_tokens
        self.prefix_cache, self.cache_generated = prefix_cache, cache_generated
        self.allocator = PageAllocator(num_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.kept: set[Request] = set()            # finished `keep_pages` requests whose pages are not released
        self.stats = SchedulerStats()
        self._admissions = itertools.count()

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step's choice --------------------------------------------------------------------------------
    def schedule(self, events: Events) -> list[tuple[Request, int]]:
        """Pick (request, tokens to add) for this step and give them pages, preempting when the pool is full."""
        if CHECK_EVERY_STEP:
            self.check()
        budget, preemptions = self.max_step_tokens, self.stats.preemptions
        scheduled: list[tuple[Request, int]] = []
        decoding = [r for r in self.running if r.num_tokens - r.num_cached == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_cached > 1]
        for r in decoding + prefilling:
            remaining = r.num_tokens - r.num_cached
            n = 1 if remaining == 1 else min(remaining, budget)
            if r.admitted >= 0 and n > 0 and self._reserve(r, n, events):   # admitted < 0: preempted meanwhile
                scheduled.append((r, n))
                budget -= n
            if self.stats.preemptions != preemptions:   # requests scheduled before r were preempted for its pages:
                preemptions = self.stats.preemptions    # they leave the step, and their tokens go back to the budget
                budget += sum(k for q, k in scheduled if q.admitted < 0)
                scheduled = [(q, k) for q, k in scheduled if q.admitted >= 0]
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            r = self.waiting[0]
            if self.pages_for(min(r.num_tokens + 1, r.max_total_tokens)) > self.num_pages:
                self.waiting.popleft()
                self.end(r, f"request {r.request_id} needs {self.pages_for(r.num_tokens + 1)} KV pages but the "
                            f"pool holds {self.num_pages} ({self.num_pages * self.page_size} tokens)", events)
                continue
            hits = self._lookup(r)
            n = min(r.num_tokens - len(hits) * self.page_size, budget)
            need = self.pages_for(len(hits) * self.page_size + n) - len(hits)
            if need > self.allocator.num_free - sum(self.allocator.refcount[h.page] == 0 for h in hits):
                break  # the pool is full: wait for running requests to finish
            self.waiting.popleft()
            self._take_cached(r, hits)
            self._reserve(r, n, events, preempt=False)   # fits: checked just above
            self._admit(r)
            scheduled.append((r, n))
            budget -= n
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        self.stats.peak_pages_used = max(self.stats.peak_pages_used, self.allocator.num_referenced)
        return scheduled

    def _lookup(self, r: Request) -> list[CachedPage]:
        """The cached pages of r's longest cached prefix, leaving at least one token to compute (its logits give
        the next token); with integrity on, only pages still carrying the tag and the bytes they were cached with:
        an entry whose page was reallocated or changed since is refused and forgotten, before anyone reads it."""
        if not self.prefix_cache:
            return []
        hits = self.allocator.lookup(r.token_ids, r.num_tokens - 1, self.page_size)
        pages = [h.page for h in hits]
        fresh = self.tracker.first_stale(pages, [h.tag for h in hits])
        valid = self.tracker.first_corrupt(pages[:fresh])   # the bytes of pages whose tags match
        if valid < len(hits):
            self.stats.stale_entries += valid == fresh
            self.stats.corrupt_entries += valid < fresh
            self.allocator.forget(hits[valid].key)
        return hits[:valid]

    def _take_cached(self, r: Request, hits: list[CachedPage]) -> None:
        """r starts from the cached pages `hits`: references to them, their keys, and their cached tags as what
        the integrity check expects."""
        self.stats.lookup_tokens += r.num_tokens if self.prefix_cache else 0
        self.stats.cached_tokens += len(hits) * self.page_size
        if r.preemptions == 0:
            r.cached_tokens = len(hits) * self.page_size
        pages = [h.page for h in hits]
        self.allocator.share(pages)
        self.tracker.on_share(pages, [h.tag for h in hits], r)
        r.page_table, r.page_keys = pages, [h.key for h in hits]
        r.num_cached = len(hits) * self.page_size

    def cache_pages(self, r: Request) -> None:
        """Put r's pages that its computed tokens now fill into the prefix cache (after a pass)."""
        if not self.prefix_cache:
            return
        size = self.page_size
        computed = r.num_cached if self.cache_generated else min(r.num_cached, len(r.prompt_token_ids))
        first = len(r.page_keys)
        if computed // size <= first:
            return   # no page filled by this pass (most decode steps): nothing to build
        for i in range(first, computed // size):
            parent = r.page_keys[-1] if r.page_keys else None
            tag = r.expected_tags[i] if r.expected_tags else 0
            tokens = tuple(r.tokens(i * size, (i + 1) * size))
            r.page_keys.append(self.allocator.insert(r.page_table[i], parent, tokens, tag))
        cached = self.allocator.cached_key   # the pages now cached as r's (not those whose prefix was cached already)
        self.tracker.on_cache([p for p, key in zip(r.page_table[first:], r.page_keys[first:]) if cached.get(p) == key])

    def _admit(self, r: Request) -> None:
        r.admitted = next(self._admissions)
        self.running.append(r)

    def _reserve(self, r: Request, n: int, events: Events, preempt: bool = True) -> bool:
        """Make r's pages cover num_cached + n tokens. May preempt the most recently admitted request (r itself
        if it is the newest); returns False if r could not be given the pages."""
        need = self.pages_for(r.num_cached + n) - len(r.page_table)
        while need > self.allocator.num_free:
            if not preempt:
                return False
            victim = max(self.running, key=lambda q: q.admitted)
            if victim is r and len(self.running) == 1:
                self.end(r, f"request {r.request_id} ran out of KV pages: it needs more than the whole pool "
                            f"({self.num_pages * self.page_size} tokens)", events)
                return False
            self._preempt(victim)
            if victim is r:
                return False
        self._give(r, need)
        return True

    def _give(self, r: Request, count: int) -> None:
        """`count` more pages for r (the caller made sure they are there), recorded with their new tags."""
        pages = self.allocator.allocate(count) or []
        self.tracker.on_allocate(pages, r)
        r.page_table += pages

    def admit_prefilled(self, r: Request) -> bool:
        """Give a request whose prompt KV was computed elsewhere pages for its prompt and run it, if the pool and
        `max_running` allow now (its KV is written into `r.page_table` next)."""
        need = self.pages_for(r.num_cached)
        if len(self.running) >= self.max_running or need > self.allocator.num_free:
            return False
        self._give(r, need)
        self._admit(r)
        return True

    # ---- leaving ------------------------------------------------------------------------------------------
    def _preempt(self, r: Request) -> None:
        self._free(r)
        r.num_cached, r.admitted = 0, -1
        r.preemptions += 1
        self.stats.preemptions += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    def finish(self, r: Request, reason: str, error: str | None = None) -> None:
        """r is done (stop, length or abort): it leaves running (at the end of the step) or waiting, and frees its
        pages unless it keeps them for a transfer."""
        r.finish_reason, r.error, r.finish_time = reason, error, time.perf_counter()
        r.admitted = -1
        if r.keep_pages and reason != "abort":
            self.kept.add(r)
        else:
            self._free(r, keep_record=True)

    def end(self, r: Request, error: str, events: Events) -> None:
        """Abort r now (from any state), with `error`; reported as (r, None)."""
        if r.finished:
            return
        self.finish(r, "abort", error)
        if r in self.waiting:
            self.waiting.remove(r)
        self.retire()
        events.append((r, None))

    def retire(self) -> None:
        """Drop finished requests from `running` (admission order is kept). When that leaves the engine idle, check
        the invariants (with integrity on, or under NANO_CHECK=1): a leaked page or a refcount that drifted shows
        then. Measured (one thread, 16-token pages, docs/paged-kv.md): check() takes 7 ms with 64 requests running
        in 4,096 pages and 24 ms in 16,384: 1.5-2% of a CPU decode step of the random stand-in (320 ms, 1.2 s), but
        host time a GPU step of a few tens of ms would grow by in full. Idle it takes 5 and 17 ms (128 ms at 65,536
        pages, all cached). So once per drain, not per step."""
        running = [r for r in self.running if r.admitted >= 0]
        drained = len(running) < len(self.running) and not running and not self.waiting
        self.running = running
        if drained and (self.tracker.enabled or CHECK_EVERY_STEP):
            self.check()

    def release(self, r: Request) -> None:
        """Free the pages a finished `keep_pages` request kept."""
        self.kept.discard(r)
        self._free(r)

    def _free(self, r: Request, keep_record: bool = False) -> None:
        """Give back the pages r owns (with integrity on: the ones still carrying the tags r was given). A request
        that finished keeps its page table and tags as the record of what it held (`nano chat`'s /pages); the
        pages are no longer its own, and no page table of a finished request is ever read for a step."""
        self.allocator.release(self.tracker.owned_pages(r))
        r.page_keys = []
        if not keep_record:
            r.page_table, r.expected_pages, r.expected_tags = [], [], []

    # ---- the invariants -----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise InvariantError naming the first invariant of the module docstring that does not hold. (Each is an
        assert, here and in PageAllocator.check: under `python -O` the check does nothing.)"""
        try:
            running, waiting = set(self.running), set(self.waiting)
            assert len(running) == len(self.running) and len(waiting) == len(self.waiting), \
                "a request is queued twice"
            assert not running & waiting and not (running | waiting) & self.kept, "a request is in two states"
            assert all(not r.finished for r in running | waiting), "a finished request is still queued"
            order = [r.admitted for r in self.running]
            assert all(a >= 0 for a in order) and order == sorted(order), "running is not in admission order"
            for r in self.waiting:
                assert r.admitted == -1 and not r.page_table and r.num_cached == 0, \
                    f"waiting request {r.request_id} holds pages or cache"
            holders = self.running + list(self.kept)
            self.allocator.check({r.request_id: r.page_table for r in holders},
                                 {r.request_id: r.num_cached for r in holders}, self.page_size,
                                 {r.request_id: r.token_ids for r in holders})
        except AssertionError as broken:
            raise InvariantError(f"scheduler invariant broken: {broken} (a bug in nano's page bookkeeping: the "
                                 f"engine stopped rather than compute from a corrupt KV pool)") from None
