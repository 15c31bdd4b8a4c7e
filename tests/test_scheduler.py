"""The scheduler's invariant check can fail, and does in production; the step budget counts only scheduled work;
requests compare by identity."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nano import LLM, NanoError, SamplingParams
from nano import scheduler as scheduler_module
from nano.engine import Engine
from nano.integrity import NullTracker
from nano.scheduler import InvariantError, Request, Scheduler

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def stand_in(tiny_glm5) -> LLM:
    return LLM(str(tiny_glm5), page_size=16, kv_budget="2MiB", max_step_tokens=32, progress=False)


@pytest.fixture()
def llm(stand_in) -> LLM:
    """The stand-in with a fresh engine (scheduler, allocator, tracker) on its model and pool, three requests
    running: each test breaks the bookkeeping its own way."""
    llm = stand_in
    llm.engine = Engine(llm.model, llm.pool, set(), llm.engine_config)
    for prompt in ([1, 2, 3] * 7, [4, 5] * 20, [6] * 9):
        llm.submit(prompt, PARAMS)
    for _ in range(3):
        llm.poll()
    return llm


def test_a_healthy_engine_passes_the_check(llm):
    scheduler = llm.engine.scheduler
    assert len(scheduler.running) == 3 and scheduler.allocator.num_free < llm.pool.num_pages
    scheduler.check()


@pytest.mark.parametrize("breakage, message", [
    ("free_owned_page", "exactly one of free / evictable / referenced"),
    ("two_tables_one_page", "page tables but its refcount"),
    ("refcount_off_by_one", "page tables but its refcount"),
    ("cached_for_other_tokens", "cached for other tokens"),
    ("missing_page", "pages for"),
    ("waiting_with_pages", "holds pages"),
    ("out_of_order", "admission order"),
    ("running_and_waiting", "two states"),
])
def test_the_check_fails_on_each_broken_invariant(llm, breakage, message):
    scheduler = llm.engine.scheduler
    first, second, third = scheduler.running
    if breakage == "free_owned_page":
        scheduler.allocator.free.append(first.page_table[0])
    elif breakage == "two_tables_one_page":
        second.page_table[0] = first.page_table[0]
    elif breakage == "refcount_off_by_one":
        scheduler.allocator.refcount[first.page_table[0]] += 1
    elif breakage == "cached_for_other_tokens":   # its first page is cached for the tokens it had
        assert first.page_table[0] in scheduler.allocator.cached_key
        first.prompt_token_ids[0] += 1
    elif breakage == "missing_page":
        scheduler.allocator.release([second.page_table.pop()])
    elif breakage == "waiting_with_pages":
        scheduler.running.remove(third)
        third.admitted = -1
        scheduler.waiting.append(third)
    elif breakage == "out_of_order":
        scheduler.running.reverse()
    elif breakage == "running_and_waiting":
        scheduler.waiting.append(first)
    with pytest.raises(InvariantError, match=f"scheduler invariant broken: .*{message}"):
        scheduler.check()


@pytest.mark.breaks_invariants   # no check after each step from conftest: only the engine's own runs
def test_production_checks_when_the_engine_goes_idle(llm):
    """A refcount that drifted (a leak: a reference nobody holds) is invisible while the requests run; the step that
    drains the engine checks the invariants and stops with the broken one named, as a NanoError."""
    scheduler = llm.engine.scheduler
    scheduler.allocator.refcount[scheduler.running[0].page_table[0]] += 1
    with pytest.raises(InvariantError, match=r"scheduler invariant broken: page \d+ is in 0 page tables but its "
                                             r"refcount is 1 \(a bug in nano's page bookkeeping") as caught:
        while llm.engine.has_work():
            llm.poll()
    assert isinstance(caught.value, NanoError) and not scheduler.running and not scheduler.waiting


@pytest.mark.breaks_invariants
def test_nano_check_checks_before_every_step(llm, monkeypatch):
    """NANO_CHECK=1: the next step finds the corruption at once, with requests still running."""
    monkeypatch.setattr(scheduler_module, "CHECK_EVERY_STEP", True)
    scheduler = llm.engine.scheduler
    scheduler.running.reverse()
    with pytest.raises(InvariantError, match="running is not in admission order"):
        llm.poll()
    assert len(scheduler.running) == 3


def test_a_preempted_decode_gives_its_tokens_back_to_the_step_budget():
    """Pages of 4 tokens, a pool of 5, 8 tokens per step. P1 and P2 are mid-prompt (4 of 16 tokens cached, one
    page each) and D, admitted last, decodes its 8th token (7 cached in 2 pages): one page is free.

    By hand: D's decode comes first and fits its second page (1 token). P1's chunk is sized with the 7 tokens left
    (tokens 4-10: two more pages); only one is free, so the newest request, D, is preempted, its two pages freed.
    D leaves the step, so its token goes back: 8 - 7 = 1 token is left, and P2 takes it (token 4: its second page,
    the last free one). Counting D's token anyway would leave 0 and schedule P2 nothing."""
    scheduler = Scheduler(5, 4, NullTracker(), max_running=8, max_step_tokens=8, prefix_cache=False)
    p1, p2, d = (Request(i, list(range(n)), PARAMS, torch.Generator(), 64) for i, n in enumerate((16, 16, 7)))
    d.output_token_ids = [7]
    for r, cached in ((p1, 4), (p2, 4), (d, 7)):
        r.num_cached = cached
        assert scheduler.admit_prefilled(r)
    assert scheduler.allocator.num_free == 1
    scheduled = scheduler.schedule([])
    assert [(r.request_id, n) for r, n in scheduled] == [(0, 7), (1, 1)]
    assert list(scheduler.waiting) == [d] and d.preemptions == 1 and scheduler.allocator.num_free == 0
    assert [len(r.page_table) for r in (p1, p2)] == [3, 2]


def test_requests_compare_by_identity():
    a = Request(0, [1, 2], PARAMS, torch.Generator(), 16)
    twin = dataclasses.replace(a, generator=a.generator)
    assert a != twin and a in [a] and twin not in [a] and len({a, twin}) == 2


def test_request_tokens_slices_the_sequence_without_building_it():
    """`tokens(start, stop)` (what a step reads) equals slicing the whole concatenated sequence, for every range."""
    r = Request(0, [11, 12, 13, 14], PARAMS, torch.Generator(), 16)
    r.output_token_ids = [21, 22, 23]
    whole = r.prompt_token_ids + r.output_token_ids
    for start in range(len(whole) + 1):
        for stop in range(start, len(whole) + 2):
            assert r.tokens(start, stop) == whole[start:stop], (start, stop)
