"""The scheduler's invariant check can fail, and requests compare by identity."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nano import LLM, SamplingParams
from nano.scheduler import Request

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture()
def llm() -> LLM:
    llm = LLM("glm-5.2-random", page_size=16, kv_budget="2MiB", max_step_tokens=32, progress=False)
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
    with pytest.raises(AssertionError, match=message):
        scheduler.check()


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
