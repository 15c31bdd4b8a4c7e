"""Faults injected on purpose into a running engine, and the trials `nano fault` and the tests run with them.

Each reproduces a real bug class by breaking the engine's bookkeeping directly, as a buggy scheduler would. Only
`nano fault` and the tests import this module; nothing in the engine does.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nano.errors import NanoError

if TYPE_CHECKING:   # `nano fault` reads the tables below before the engine (torch) loads
    from nano.batch import ForwardBatch
    from nano.disagg import SplitLLM
    from nano.disagg.protocol import Transfer
    from nano.engine import Engine
    from nano.kv import PageAllocator


FAULT_KINDS = {
    "corrupt-page-table": "one entry of a running request's page table is overwritten with another live "
                          "request's page",
    "use-after-free": "a running request's page is freed early; the next admitted request is given it",
    "double-alloc": "a page a running request still holds is handed to the next admitted request as well",
    "stale-tag": "a running request's page is freed early and reallocated without bumping its tag",
    "kv-bitflip": "the sign bit of every value in one of a running request's pages is flipped",
    "late-write": "a request ends, its pages go to the newcomer, then its KV lands through its stale page table",
    "bad-write-slot": "after the check, one new token's write address is moved into another request's page",
    "table-after-check": "after the check, one entry of the page table attention reads is changed to another "
                         "request's page",
    "evict-referenced": "a refcount bug: a prefix page several running requests share through the prefix cache is "
                        "evicted as if unreferenced; the next admitted request is given it",
    "stale-cache-entry": "a cached prefix page is evicted and reallocated but its prefix-cache entry stays; later "
                         "requests with that prefix find it",
    "corrupt-shared-page": "the sign bit of every value in a cached prefix page is flipped; later requests with that "
                           "prefix find it",
}
# which faults the check can see (tags, and cached pages' checksums): stale-tag shows why the bump matters,
# kv-bitflip that only cached pages' bytes are checked
DETECTABLE = {"corrupt-page-table", "use-after-free", "double-alloc", "late-write", "evict-referenced",
              "stale-cache-entry", "corrupt-shared-page"}
# their scenario: prompts sharing a prefix; those found at a later request's lookup, with the stat of their refusals
AT_LOOKUP = {"stale-cache-entry": "stale_entries", "corrupt-shared-page": "corrupt_entries"}
CACHE_FAULTS = {"evict-referenced", *AT_LOOKUP}


@dataclass
class Injection:
    kind: str
    victim: int       # the request whose KV goes wrong
    page: int         # the physical page involved
    detail: str       # one line: what exactly was done
    after_step: Callable[[], None] | None = None   # late-write: the write itself, once the newcomer holds the pages
    collateral: int | None = None   # late-write: the request the fault ended to free its pages (not compared)
    refused: bool = False           # late-write: the engine refused the stale write; AT_LOOKUP: the cache entry
    hit: list[int] = dataclasses.field(default_factory=list)   # every request the fault hits (evict-referenced:
                                                               # all that share the page), the victim among them


def _hand_out_next(allocator: PageAllocator, pages: list[int], referenced: bool = False,
                   keep_entry: bool = False) -> None:
    """The bug the allocation faults share: `pages` go to the front of the free list (a LIFO allocator), so the
    next allocation receives them. Unless `referenced`, the books also forget whoever holds them (refcount 0);
    unless `keep_entry`, their prefix-cache entries go, as a real eviction's would."""
    for page in reversed(pages):
        if not referenced:
            allocator.refcount[page] = 0
        allocator.evictable.pop(page, None)
        if page in allocator.free:
            allocator.free.remove(page)
        allocator.free.appendleft(page)
        if not keep_entry and page in allocator.cached_key:
            del allocator.cache[allocator.cached_key.pop(page)]


def inject(kind: str, engine: Engine, rng: random.Random) -> Injection:
    """Break the engine's state in the way `kind` names, choosing the victim (a decoding request) and its page
    with `rng`. The faults that free or hand out a page put it at the front of the free list (a LIFO bug), so the
    next allocation — a newly admitted request — receives it."""
    if kind in AT_LOOKUP:
        return _cached_prefix_fault(kind, engine, rng)
    decoding = sorted((r for r in engine.scheduler.running if r.page_table and r.num_tokens - r.num_cached == 1),
                      key=lambda r: r.request_id)
    if not decoding or (kind in ("corrupt-page-table", "bad-write-slot", "table-after-check") and len(decoding) < 2):
        raise RuntimeError(f"{kind}: no running request to inject into")
    victim = rng.choice(decoding)
    index = rng.randrange(len(victim.page_table))
    page = victim.page_table[index]
    allocator, tracker = engine.scheduler.allocator, engine.integrity
    if kind == "corrupt-page-table":
        other = rng.choice([r for r in decoding if r is not victim])
        foreign = rng.choice(other.page_table)
        victim.page_table[index] = foreign
        return Injection(kind, victim.request_id, foreign,
                         f"request {victim.request_id}'s logical page {index} now points at physical page {foreign} "
                         f"(request {other.request_id}'s) instead of {page}")
    if kind == "evict-referenced":
        shared = [p for p in victim.page_table if allocator.refcount[p] > 1]
        if not shared:
            raise RuntimeError(f"{kind}: request {victim.request_id} shares no page (the prompts need a common "
                               f"prefix and the prefix cache on)")
        page = rng.choice(shared)
        holders = sorted(r.request_id for r in engine.scheduler.running if page in r.page_table)
        _hand_out_next(allocator, [page])
        return Injection(kind, victim.request_id, page,
                         f"physical page {page}, shared by requests {', '.join(map(str, holders))} through the prefix "
                         f"cache (refcount {len(holders)}), was evicted as if unreferenced; the next admitted request "
                         f"gets it", hit=holders)
    if kind in ("use-after-free", "stale-tag", "double-alloc"):
        _hand_out_next(allocator, [page], referenced=kind == "double-alloc")  # double-alloc: still owned in the books
        if kind == "stale-tag" and tracker.enabled:   # undo the bump the coming reallocation will make
            tracker.host_tags[page] -= 1
            tracker.page_tags[page] -= 1
        what = {"use-after-free": "freed while the request still decodes",
                "stale-tag": "freed while the request still decodes, to be reallocated without a tag bump",
                "double-alloc": "put back on the free list while the request still holds it"}[kind]
        return Injection(kind, victim.request_id, page,
                         f"physical page {page} (request {victim.request_id}'s logical page {index}) {what}; "
                         f"the next admitted request gets it")
    if kind in ("bad-write-slot", "table-after-check"):
        return _after_the_check(kind, engine, victim, index, rng.choice([r for r in decoding if r is not victim]))
    if kind == "late-write":
        return _late_write(engine, victim)
    if kind == "kv-bitflip":
        return Injection(kind, victim.request_id, page, f"flipped the sign bit of all {_flip_signs(engine, page):,} "
                         f"KV values in physical page {page} (request {victim.request_id}'s logical page {index})")
    raise ValueError(f"unknown fault {kind!r}; one of {', '.join(FAULT_KINDS)}")


def _after_the_check(kind: str, engine: Engine, victim, index: int, other) -> Injection:
    """Change the next pass's batch between the check and the model (a forward pre-hook, once): a write address
    of the victim's new token moves into `other`'s first page, or an entry of the victim's table points there."""
    foreign, size = other.page_table[0], engine.pool.page_size

    def hook(_model: object, args: tuple) -> None:
        batch: ForwardBatch = args[2]
        if kind == "bad-write-slot":   # the slot of the victim's new token (its page is reserved by now)
            if victim.num_cached // size >= len(victim.page_table):
                return                                                  # not in this pass: wait for its own
            own_slot = victim.page_table[victim.num_cached // size] * size + victim.num_cached % size
            rows = (batch.slots == own_slot).nonzero().flatten()
            if len(rows):
                batch.slots[rows[0]] = foreign * size                   # other's token 0, already written
                handle.remove()
            return
        for group in batch.groups:
            width = len(victim.page_table)
            for row, table in enumerate(group.page_table[:, :width].tolist()):
                if table == victim.page_table and group.page_table.shape[1] >= width:
                    group.page_table[row, index] = foreign
                    handle.remove()
                    return

    handle = engine.model.register_forward_pre_hook(hook)
    what = (f"its new token's write address moved into physical page {foreign}" if kind == "bad-write-slot" else
            f"its logical page {index} in the table attention reads changed to physical page {foreign}")
    return Injection(kind, victim.request_id, foreign, f"request {victim.request_id}: after the check, {what} "
                                                       f"(request {other.request_id}'s)")


def _late_write(engine: Engine, stale) -> Injection:
    """`stale` ends now; its pages go to the front of the free list (a LIFO allocator), so the newcomer admitted
    next receives them; after that step its KV lands through its old page table and tags (Engine.import_kv)."""
    pages, tags = list(stale.page_table), list(stale.expected_tags)
    parts = engine.pool.export_tokens(pages, stale.num_cached)
    engine.abort(stale, "ended by the fault: its pages go to the newcomer before its late write")
    _hand_out_next(engine.scheduler.allocator, pages)
    injection = Injection("late-write", -1, pages[0], f"request {stale.request_id} ended; its {len(pages)} pages "
                          f"(first: {pages[0]}) went to the newcomer; then its KV was written through its stale "
                          f"page table", collateral=stale.request_id)

    def write() -> None:
        newcomer = max(engine.scheduler.running, key=lambda r: r.request_id)
        injection.victim = newcomer.request_id
        try:
            engine.import_kv(pages, tags, parts)
        except NanoError:
            injection.refused = True

    injection.after_step = write
    return injection


def _flip_signs(engine: Engine, page: int) -> int:
    """Flip the sign bit of every KV value in `page` (all layers); returns how many values."""
    import torch
    values = engine.pool.kv[:, page]                                            # [L, page_size, C + R]
    bits = values.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[values.element_size()])
    bits ^= torch.iinfo(bits.dtype).min                                        # the sign bit
    return values.numel()


def _cached_prefix_fault(kind: str, engine: Engine, rng: random.Random) -> Injection:
    """Every request has finished; the pages of the prefix they shared are cached, unreferenced. stale-cache-entry:
    the first is evicted to the newcomer admitted next, but its cache entry is left behind, pointing at the
    newcomer's KV. corrupt-shared-page: the bytes of one of them (`rng`'s choice) change in place. Either way the
    requests that come next with the prefix find the entry."""
    allocator = engine.scheduler.allocator
    roots = [entry for entry in allocator.cache.values() if entry.parent is None and entry.page in allocator.evictable]
    if engine.scheduler.running or not roots:
        raise RuntimeError(f"{kind}: no cached, unreferenced prefix page to inject into")
    if kind == "stale-cache-entry":
        _hand_out_next(allocator, [roots[0].page], keep_entry=True)
        return Injection(kind, -1, roots[0].page, f"physical page {roots[0].page}, the cached first page of the "
                         f"shared prefix, was evicted to the newcomer but its prefix-cache entry stayed; the requests "
                         f"that come next with that prefix find it")
    second = [entry for entry in allocator.cache.values() if entry.parent == roots[0].key]
    shared = [roots[0], *(second if len(second) == 1 else [])]   # the prefix's pages every request holds
    index = rng.randrange(len(shared))
    page = shared[index].page
    return Injection(kind, -1, page, f"flipped the sign bit of all {_flip_signs(engine, page):,} KV values in "
                     f"physical page {page}, the cached page {index} of the shared prefix; the requests that come "
                     f"next with that prefix find it")


# ---- fault trials: a golden run, then the same run with a fault injected mid-decode ----------------------------

@dataclass
class FaultScenario:
    """Requests that start together, a newcomer admitted right after the fault, greedy decoding. With a shared
    prefix (the cache faults), the first request runs a step alone so that the others find the prefix in the
    cache, and `late` requests with the prefix arrive the step after the newcomer."""
    prompts: list[list[int]]
    newcomer: list[int]
    max_tokens: int
    inject_step: int | None   # the fault is injected (and the newcomer added) after this many engine steps; None:
                              # once the first requests have all finished
    late: list[list[int]] = dataclasses.field(default_factory=list)
    staggered: bool = False

    @classmethod
    def random(cls, vocab_size: int, seed: int, requests: int = 6, prompt_len: int = 40, max_tokens: int = 12,
               inject_step: int | None = 4, shared_prefix: int = 0, late: int = 0) -> FaultScenario:
        rng = random.Random(seed)
        prefix = [rng.randrange(vocab_size) for _ in range(shared_prefix)]
        prompt = lambda: [rng.randrange(vocab_size) for _ in range(rng.randint(prompt_len // 2, prompt_len))]
        return cls([prefix + prompt() for _ in range(requests)], prompt(), max_tokens, inject_step,
                   [prefix + prompt() for _ in range(late)], staggered=shared_prefix > 0)


@dataclass
class TrialOutcome:
    injection: Injection | None
    outputs: list[list[int]]       # generated ids per request (the newcomer last)
    errors: dict[int, str]         # request index -> error, for every aborted request
    victim: int | None             # index of the request the fault hit
    detected: bool                 # the victim was aborted by the integrity check
    silent_wrong: list[int]        # requests that finished without an error but differ from the golden run
    false_positive: list[int]      # requests the check aborted although the fault did not hit them


def run_scenario(engine: Engine, scenario: FaultScenario, kind: str | None = None, rng: random.Random | None = None,
                 golden: list[list[int]] | None = None) -> TrialOutcome:
    """Run the scenario on a fresh engine, injecting `kind` (if any) when the scenario says; compare with the
    golden outputs when given."""
    from nano.sampling import SamplingParams
    # with late requests, the first ones only fill the prefix cache for them before the fault: one token each
    first = SamplingParams(max_tokens=1 if scenario.late else scenario.max_tokens, temperature=0.0, ignore_eos=True)
    params = dataclasses.replace(first, max_tokens=scenario.max_tokens)
    add = lambda prompt, sampling=params: engine.add(prompt, sampling, len(prompt) + sampling.max_tokens)
    requests = [add(p, first) for p in scenario.prompts[:1 if scenario.staggered else None]]
    injection, steps, newcomer_step, late = None, 0, None, []
    while engine.has_work() or newcomer_step is None or len(late) < len(scenario.late):
        if len(requests) < len(scenario.prompts) and steps >= 1:   # staggered: the rest join after the first
            requests += [add(p, first) for p in scenario.prompts[len(requests):]]
        due = steps == scenario.inject_step if scenario.inject_step is not None else not engine.has_work()
        if newcomer_step is None and len(requests) == len(scenario.prompts) and due:
            if kind is not None:
                injection = inject(kind, engine, rng or random.Random(0))
            requests.append(add(scenario.newcomer))
            newcomer_step = steps
        elif newcomer_step is not None and steps > newcomer_step and len(late) < len(scenario.late):
            late = [add(p) for p in scenario.late]
            requests += late
            if injection is not None and injection.kind in AT_LOOKUP:
                injection.victim, injection.hit = late[0].request_id, [r.request_id for r in late]
        engine.step()
        steps += 1
        if injection is not None and injection.after_step is not None and steps > newcomer_step:
            injection.after_step()
            injection.after_step = None
    if injection is not None and injection.kind in AT_LOOKUP:   # refused when it was looked up
        injection.refused = getattr(engine.scheduler.stats, AT_LOOKUP[injection.kind]) > 0
    outputs = [r.output_token_ids for r in requests]
    index = {r.request_id: i for i, r in enumerate(requests)}
    collateral = index.get(injection.collateral) if injection else None
    errors = {i: r.error or "" for i, r in enumerate(requests) if r.finish_reason == "abort" and i != collateral}
    victim = index[injection.victim] if injection else None
    hit = {index[request_id] for request_id in injection.hit} if injection else set()
    detected = injection is not None and (injection.refused or (victim in errors
                                                                 and errors[victim].startswith("KV integrity")))
    silent_wrong = [] if golden is None else [i for i, out in enumerate(outputs)
                                              if i not in errors and i != collateral and out != golden[i]]
    false_positive = [i for i, e in errors.items() if i != victim and i not in hit and e.startswith("KV integrity")]
    return TrialOutcome(injection, outputs, errors, victim, detected, silent_wrong, false_positive)


# ---- faults on the split ------------------------------------------------------------------------------------------
# A test-only wrapper around the split's front (nano/disagg/front.py), used by `nano fault --corrupt-transfer` and
# tests/test_disagg.py. Nothing of it travels in the split's protocol, and the split never imports it.
@contextmanager
def corrupt_next_transfer(split: SplitLLM) -> Iterator[list[int]]:
    """While the block runs, the next transfer the front forwards reaches the decode worker corrupted; yields the
    list of request ids it hit (one).

    With shm the front maps the staging buffer too: one byte of the slot is flipped after the prefill worker has
    checksummed it and before the Decode message goes out, so the decode worker reads changed bytes. With gloo the
    bytes never pass through the front, so the Decode message carries the checksum with one bit flipped: what the
    decode worker sees when bytes change on the wire. Either way it covers the decode side's verification, the
    abort of that request alone and the return of its slot; it does not measure the checksum's strength."""
    forward, hit = split._forward, []

    def corrupted(request: Any, transfer: Transfer) -> None:
        if not hit:
            hit.append(transfer.request_id)
            if split.staging is not None:
                split.staging.slot(transfer.slot, transfer.nbytes)[transfer.nbytes // 2] ^= 0xFF
            else:
                transfer = dataclasses.replace(transfer, checksum=transfer.checksum ^ 1)
        forward(request, transfer)

    split._forward = corrupted   # shadows the method on this instance only
    try:
        yield hit
    finally:
        del split._forward
