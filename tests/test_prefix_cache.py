"""The prefix cache: full pages shared between requests whose tokens start the same way, refcounted, evicted least
recently used, and the integrity check where pages are really shared.

Outputs are compared with the same engine run with the cache off (float32, greedy); token counts with arithmetic
of the prompts and the page size. The scheduler's invariants (refcounts, states, cached tokens) are checked after
every step by conftest.py.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from fixtures import nano

from nano import LLM, SamplingParams
from nano.cli.faults import AT_LOOKUP, CACHE_FAULTS, FaultScenario, run_scenario
from nano.engine import Engine
from nano.kv import PageAllocator
from nano.llm import resolve_config

PAGE = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_glm5) -> LLM:
    """A tiny random GLM-5 (conftest.py): random, so that a fault that reaches a cached page changes answers."""
    return LLM(str(tiny_glm5), page_size=PAGE, kv_budget="4MiB", max_step_tokens=64, progress=False)


def engine_for(llm: LLM, prefix_cache: bool = True, integrity: bool = True, **options) -> Engine:
    return Engine(llm.model, llm.pool, set(), prefix_cache=prefix_cache, integrity=integrity, **options)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY, stagger: bool = True
        ) -> list[list[int]]:
    """Submit the prompts one step apart (so later ones can find earlier ones' pages) and run to the end."""
    requests = []
    for prompt in prompts:
        requests.append(engine.add(prompt, params, len(prompt) + params.max_tokens))
        if stagger:
            engine.step()
    while engine.has_work():
        engine.step()
    assert all(r.finish_reason == "length" for r in requests), [r.error for r in requests]
    return [r.output_token_ids for r in requests]


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(count)]   # inside every stand-in vocabulary


# ---- the allocator -----------------------------------------------------------------------------------------------
def test_refcounts_eviction_order_and_lookup():
    allocator = PageAllocator(4)
    a = allocator.allocate(2)
    keys = [allocator.insert(a[0], None, (1, 2), tag=1)]
    keys.append(allocator.insert(a[1], keys[0], (3, 4), tag=1))
    hits = allocator.lookup([1, 2, 3, 4, 5], 5, page_size=2)
    assert [h.page for h in hits] == a                        # the whole two-page prefix
    assert allocator.lookup([1, 2, 9, 9], 4, page_size=2)[0].page == a[0] and \
        len(allocator.lookup([1, 2, 9, 9], 4, page_size=2)) == 1
    assert allocator.lookup([1, 2, 3, 4], 3, page_size=2) == hits[:1]   # at most 3 tokens: one whole page
    assert allocator.lookup([3, 4], 2, page_size=2) == []     # the same tokens after another prefix: no match
    allocator.share(a)                                        # a second holder
    allocator.release(a)
    assert allocator.refcount[a[0]] == 1 and allocator.num_free == 2
    allocator.release([a[1]])
    allocator.release([a[0]])                                 # a[1] released first: it is evicted first
    assert allocator.num_free == 4 and len(allocator.free) == 2 and list(allocator.evictable) == [a[1], a[0]]
    allocator.check({}, {}, page_size=2)
    assert allocator.allocate(3) == [2, 3, a[1]]              # free pages first, then the least recently used
    assert allocator.lookup([1, 2, 3, 4, 5], 5, page_size=2) == hits[:1]   # a[1]'s entry went with it
    allocator.check({7: [2, 3], 8: [a[1]]}, {7: 4, 8: 2}, page_size=2)


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    import nano.kv
    monkeypatch.setattr(nano.kv, "page_key", lambda parent, page_tokens: 42)   # every page the same key
    allocator = PageAllocator(2)
    page = allocator.allocate(1)[0]
    allocator.insert(page, None, (1, 2), tag=1)
    assert allocator.lookup([5, 6, 7], 3, page_size=2) == []   # the key matches, the tokens do not


# ---- the engine --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype, kv_layout", [("fp32", "token"), ("fp8", "token"), ("fp8", "tensor"),
                                                 ("fp8", "tile")])
def test_identical_outputs_with_the_cache_on_and_off_under_preemption(tiny_glm5, kv_dtype, kv_layout):
    """Concurrent requests sharing prefixes (one system prompt, and follow-ups that extend earlier prompts) in a
    pool far smaller than the demand: pages are shared, evicted and requests preempted, and every output equals
    the run with the cache off, in every page format (a cached FP8 page is the bytes the request wrote)."""
    per_token = resolve_config(str(tiny_glm5))[1].kv_bytes_per_token(kv_dtype, kv_layout)
    small = LLM(str(tiny_glm5), page_size=4, kv_budget=48 * 4 * per_token, max_step_tokens=48, progress=False,
                kv_dtype=kv_dtype, kv_layout=kv_layout)
    rng = random.Random(11)
    system = tokens(rng, 22)
    prompts = [system + tokens(rng, rng.randint(1, 18)) for _ in range(8)]
    prompts += [prompts[i] + tokens(rng, 5) for i in (0, 3)]             # extend two earlier prompts
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert sum(len(p) + 12 for p in prompts) > 2 * small.pool.tokens    # the demand is over twice the pool
    runs = {}
    for cache in (True, False):
        engine = engine_for(small, prefix_cache=cache, max_step_tokens=48)
        runs[cache] = (run(engine, prompts, params, stagger=False), engine.counters())
    (on, stats), (off, stats_off) = runs[True], runs[False]
    assert on == off
    assert stats["cached_tokens"] > 0 and stats["preemptions"] > 0 and stats["mismatched"] == 0
    assert stats["prefill_tokens"] < stats_off["prefill_tokens"]
    assert stats_off["cached_tokens"] == stats_off["lookup_tokens"] == 0


def test_a_request_prefills_only_past_its_cached_pages(llm):
    rng = random.Random(1)
    first = tokens(rng, 3 * PAGE + 5)
    second = first[:2 * PAGE + 7] + tokens(rng, 9)      # shares two whole pages, then differs
    again = first[:3 * PAGE]                            # the first three pages exactly: one token is recomputed
    engine = engine_for(llm)
    run(engine, [first])
    engine.reset_counters()
    run(engine, [second])
    assert engine.counters()["cached_tokens"] == 2 * PAGE
    assert engine.counters()["prefill_tokens"] == len(second) - 2 * PAGE
    engine.reset_counters()
    outputs = run(engine, [again])
    counters = engine.counters()
    assert counters["cached_tokens"] == 2 * PAGE and counters["prefill_tokens"] == PAGE   # the last page again
    assert counters["lookup_tokens"] == len(again)
    assert outputs == run(engine_for(llm, prefix_cache=False), [again])


def test_shared_pages_are_read_in_place_by_every_holder(llm):
    """Requests with one prefix hold the same physical pages at once (refcount = holders), the bytes are not
    rewritten, and aborting one holder leaves the pages to the others."""
    rng = random.Random(2)
    prefix = tokens(rng, 2 * PAGE)
    prompts = [prefix + tokens(rng, 6 + i) for i in range(3)]
    golden = run(engine_for(llm, prefix_cache=False), prompts)
    engine = engine_for(llm)
    requests = []
    for prompt in prompts:
        requests.append(engine.add(prompt, GREEDY, len(prompt) + GREEDY.max_tokens))
        engine.step()
    shared = requests[0].page_table[:2]
    assert all(r.page_table[:2] == shared for r in requests)
    assert [engine.scheduler.allocator.refcount[p] for p in shared] == [3, 3]
    before = llm.pool.kv[:, shared].clone()
    engine.abort(requests[1], "the caller went away")
    assert [engine.scheduler.allocator.refcount[p] for p in shared] == [2, 2]
    while engine.has_work():
        engine.step()
    assert (llm.pool.kv[:, shared] == before).all()          # written once, by the first request's prefill
    assert [requests[0].output_token_ids, requests[2].output_token_ids] == [golden[0], golden[2]]
    assert [engine.scheduler.allocator.refcount[p] for p in shared] == [0, 0]
    assert all(p in engine.scheduler.allocator.evictable for p in shared)   # cached, for whoever comes next


def test_fp8_pages_are_cached_as_they_are(tiny_glm5):
    fp8 = LLM(str(tiny_glm5), page_size=PAGE, kv_dtype="fp8", kv_budget="2MiB", progress=False)
    rng = random.Random(3)
    prefix = tokens(rng, 2 * PAGE)
    prompts = [prefix + tokens(rng, 5), prefix + tokens(rng, 8)]
    engine = engine_for(fp8)
    assert run(engine, prompts) == run(engine_for(fp8, prefix_cache=False), prompts)
    assert engine.counters()["cached_tokens"] == 2 * PAGE


def test_multi_turn_prefill_stays_flat_as_the_conversation_grows(llm):
    """Each turn's prompt is the whole conversation so far; with the cache the model computes only what the
    cached pages do not cover: less than a page plus the last reply and the new message, whatever the length."""
    rng = random.Random(4)
    conversation, computed = [], []
    engine = engine_for(llm)
    for turn in range(7):
        message = tokens(rng, 12)
        prompt = conversation + message
        engine.reset_counters()
        reply = run(engine, [prompt])[0]
        computed.append(engine.counters()["prefill_tokens"])
        if turn:
            assert computed[-1] < PAGE + len(message) + GREEDY.max_tokens, computed
        conversation = prompt + reply
    assert len(prompt) > 3 * max(computed[1:])   # the last prompt is far longer than any later turn's prefill


def test_with_per_phase_weights_only_prompt_pages_are_cached(tiny_glm5):
    """Decode and prefill keep different weights: a generated token's KV (decode weights) is not what a prefill
    would compute, so only pages of prompt tokens are cached."""
    mixed = LLM(str(tiny_glm5), page_size=PAGE, prefill_weights="bf16", decode_weights="int4", kv_budget="2MiB",
                progress=False)
    rng = random.Random(5)
    prompt = tokens(rng, PAGE + 4)
    params = SamplingParams(temperature=0, max_tokens=PAGE, ignore_eos=True)   # the second page ends in the reply
    first = mixed.generate([prompt], params)[0]
    mixed.counters(reset=True)
    mixed.generate([prompt + first.token_ids + tokens(rng, 3)], GREEDY)
    assert mixed.counters()["cached_tokens"] == PAGE       # the prompt's one full page, none of the reply's


def test_switching_integrity_clears_the_cache(llm):
    engine = engine_for(llm)
    rng = random.Random(6)
    prompts = [tokens(rng, 2 * PAGE + 3)]
    first = run(engine, prompts)
    engine.set_integrity(False)
    engine.set_integrity(True)      # a new tracker: the old entries' tags mean nothing to it
    assert run(engine, prompts) == first
    assert engine.counters()["cached_tokens"] == 0 and engine.counters()["mismatched"] == 0


def test_no_prefix_cache_flag_switches_it_off(tiny_glm5):
    """Four prompts sharing a 32-token prefix, one at a time: with the flag nothing is taken from the cache and
    every prompt token is computed; without it, the later three take the prefix's two pages."""
    figures = {}
    for flag in ("--no-prefix-cache", "--prefix-cache"):
        result = nano("bench", str(tiny_glm5), flag, "--concurrency", "1", "--num-prompts", "4", "--shared-prefix",
                      "32", "--input-len", "8", "--output-len", "2", "--page-size", "16", "--warmup", "0", "--json")
        assert result.exit_code == 0, result.output
        figures[flag] = json.loads(result.stdout)["runs"][0]["results"][0]["prefix_cache"]
    off, on = figures["--no-prefix-cache"], figures["--prefix-cache"]
    assert off["enabled"] is False and off["cached_tokens"] == 0 and off["prefill_tokens"] == 4 * 40
    assert on["enabled"] is True and on["cached_tokens"] == 3 * 32 and on["prefill_tokens"] == 4 * 40 - 3 * 32


def test_a_changed_byte_in_a_cached_page_is_refused_at_the_hit(llm):
    """One byte of a cached prefix page changes after it was cached (the top byte, sign and exponent, of one latent
    value in layer 0: a value of hundredths becomes hundreds), before two later requests with the prefix arrive.
    With integrity on, the hit is refused (its checksum differs; the entry is forgotten and the first of them
    computes the prefix itself) and every output equals a run without the cache. Off, nothing notices, and the
    requests that take the page answer wrong: the blind spot the reliability report found (bypass J)."""
    rng = random.Random(0)
    prefix = tokens(rng, 2 * PAGE)
    prompts = [prefix + tokens(rng, 8) for _ in range(3)]
    reference = run(engine_for(llm, prefix_cache=False), prompts)
    outputs = {}
    for integrity in (True, False):
        engine = engine_for(llm, integrity=integrity)
        outputs[integrity] = run(engine, prompts[:1])
        root = next(e.page for e in engine.scheduler.allocator.cache.values() if e.parent is None)
        llm.pool.kv.view(torch.uint8)[0, root, 3, 3] = 0x43    # [layers, P, page_size, (C + R) * 4 bytes]
        outputs[integrity] += run(engine, prompts[1:])
        counters = engine.counters()
        assert counters["corrupt_entries"] == counters["mismatched"] == integrity and counters["aborted"] == 0
        # off, both take the prefix; on, the third takes the prefix's pages as the second recomputed them
        assert counters["cached_tokens"] == (1 if integrity else 2) * 2 * PAGE
    assert outputs[True] == reference
    assert outputs[False][0] == reference[0] and outputs[False][1] != reference[1] and \
        outputs[False][2] != reference[2]


# ---- the cache faults ----------------------------------------------------------------------------------------------
@pytest.mark.breaks_invariants
@pytest.mark.parametrize("kind", sorted(CACHE_FAULTS))
def test_cache_faults_are_caught_with_integrity_and_silent_without(llm, kind):
    """evict-referenced: every request sharing the evicted page is aborted before attention reads it, the others
    equal the golden run. stale-cache-entry, corrupt-shared-page: the entry is refused at lookup and the requests
    compute the prefix themselves (equal to the golden run). Without integrity all give wrong answers and no
    error."""
    late = 3 if kind in AT_LOOKUP else 0
    for seed in range(1):
        scenario = FaultScenario.random(llm.config.vocab_size, seed, requests=3, max_tokens=6, shared_prefix=2 * PAGE,
                                        late=late, inject_step=None if late else 3)
        golden = run_scenario(engine_for(llm, max_running=8), scenario).outputs
        engine = engine_for(llm, max_running=8)
        caught = run_scenario(engine, scenario, kind, random.Random(seed), golden)
        assert caught.detected and caught.silent_wrong == [] and caught.false_positive == [], caught.injection.detail
        if kind == "evict-referenced":
            assert len(caught.injection.hit) == 3 and set(caught.errors) == {0, 1, 2}   # all that shared the page
            assert all("KV integrity" in e for e in caught.errors.values())
            assert caught.outputs[3] == golden[3]                                    # the newcomer that got it
        else:
            assert caught.errors == {} and caught.outputs == golden
            assert getattr(engine.scheduler.stats, AT_LOOKUP[kind]) == 1 and engine.integrity.aborted == 0
        engine.scheduler.allocator.check({}, {}, PAGE)   # nobody holds a page once all is done
        silent = run_scenario(engine_for(llm, integrity=False, max_running=8), scenario, kind, random.Random(seed),
                              golden)
        assert not silent.errors and silent.victim in silent.silent_wrong


@pytest.mark.breaks_invariants
@pytest.mark.parametrize("kind", sorted(CACHE_FAULTS))
def test_cli_cache_faults(kind, tiny_glm5):
    report = json.loads(nano("fault", str(tiny_glm5), f"--{kind}", "--trials", "3", "--requests", "3",
                             "--json").stdout)
    assert (report["injected"], report["detected"], report["silent_wrong"], report["false_positive"]) == (3, 3, 0, 0)
