"""KV page integrity: a tag on every physical page, the expected (page, tag) pairs in every request, and one
batched check per step — plus the faults it exists to catch, injected on purpose.

When hundreds of requests share one pool, a bookkeeping bug (a page freed while its request still decodes, a
page table pointing at a freed page, one page handed to two requests) makes a request attend over another
request's KV and answer with wrong text, with no error anywhere. The tracker makes every such mix-up visible:

  * each physical page p has a tag, a 64-bit counter bumped every time p is allocated; a (page, tag) pair
    therefore names one allocation, and a reference that outlives it can never match again;
  * when the scheduler gives pages to a request, the request records the (page, tag) pairs it was given: the
    expectation lives with the request (as ZFS keeps a block's checksum in its parent), not only in the page;
  * after scheduling and before the forward pass reads the pool, `check` compares, for every scheduled request
    at once, the page-table rows attention is about to use with the recorded pages, and the pool's current tags
    with the recorded tags: a few tensor ops over the whole batch and one host sync;
  * a mismatch aborts that request only, before anything reads (or writes) the wrong page.

Tags protect the *mapping* (which allocation a request reads), not the bytes inside a page: a bit flip in KV
data is invisible to them. `NullTracker` (integrity=False) keeps the interface and does no work at all.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nano.engine import Engine, Request
    from nano.model import ForwardBatch


class IntegrityTracker:
    enabled = True

    def __init__(self, num_pages: int, device: torch.device) -> None:
        self.page_tags = torch.zeros(num_pages, dtype=torch.int64, device=device)   # [P] each page's current tag
        self.host_tags = [0] * num_pages   # the same counters on the host, so recording a tag costs no device sync
        self.checked = 0      # request rows checked (one per scheduled request per step)
        self.mismatched = 0   # page-table entries whose page or tag differed from the record
        self.aborted = 0      # requests aborted because of a mismatch

    def on_allocate(self, pages: list[int], request: Request | None = None) -> None:
        """Bump the tags of freshly allocated pages; record (page, new tag) in the request that receives them."""
        if not pages:
            return
        for page in pages:
            self.host_tags[page] += 1
        self.page_tags[torch.tensor(pages, device=self.page_tags.device)] += 1
        if request is not None:
            request.expected_pages += pages
            request.expected_tags += [self.host_tags[page] for page in pages]

    def owned_pages(self, request: Request) -> list[int]:
        """The pages a request may give back: the ones it was given whose tag has not changed since. A page that
        was reallocated under it (a bug elsewhere) belongs to its new owner and must not be freed again."""
        return [p for p, tag in zip(request.expected_pages, request.expected_tags) if self.host_tags[p] == tag]

    def check(self, requests: list[Request], batch: ForwardBatch) -> dict[int, str]:
        """Compare what attention is about to read with what each request was given. `requests[i]` owns seqs[i]
        of the batch. Returns {i: error} for every request whose page table or tags differ from its record."""
        device = self.page_tags.device
        flagged: dict[int, str] = {}
        row_owner: list[int] = []
        wrong_rows = []
        for group in batch.groups:
            used = group.page_table                                                     # [B, W] int64
            width = used.shape[1]
            members = [requests[i] for i in group.members]
            for i, r in zip(group.members, members):   # a table longer or shorter than the record: no tensor needed
                if len(r.page_table) != len(r.expected_pages):
                    flagged[i] = self._describe(r)
            expected_pages = torch.tensor([(r.expected_pages + [0] * width)[:width] for r in members], device=device)
            expected_tags = torch.tensor([(r.expected_tags + [0] * width)[:width] for r in members], device=device)
            lengths = torch.tensor([len(r.page_table) for r in members], device=device)
            valid = torch.arange(width, device=device) < lengths[:, None]               # [B, W] real entries
            wrong = ((used != expected_pages) | (self.page_tags[used] != expected_tags)) & valid   # [B, W]
            wrong_rows.append(wrong.any(1))
            row_owner += group.members
        self.checked += len(row_owner)
        for row in torch.cat(wrong_rows).nonzero().flatten().tolist():   # the one host sync of a clean step
            flagged.setdefault(row_owner[row], self._describe(requests[row_owner[row]]))
        self.mismatched += sum(self._count_mismatches(requests[i]) for i in flagged)
        self.aborted += len(flagged)
        return flagged

    def _mismatches(self, r: Request) -> list[tuple[int, int, int, int, int]]:
        """(index, expected page, expected tag, found page, found tag) for each entry that differs (slow path)."""
        found_tags = self.page_tags[torch.tensor(r.page_table, device=self.page_tags.device)].tolist()
        return [(i, expected_page, expected_tag, page, tag)
                for i, (expected_page, expected_tag, page, tag)
                in enumerate(zip(r.expected_pages, r.expected_tags, r.page_table, found_tags))
                if (page, tag) != (expected_page, expected_tag)]

    def _count_mismatches(self, r: Request) -> int:
        return max(1, len(self._mismatches(r)))

    def _describe(self, r: Request) -> str:
        mismatches = self._mismatches(r)
        if not mismatches:
            return (f"KV integrity: request {r.request_id}: its page table has {len(r.page_table)} pages but it was "
                    f"given {len(r.expected_pages)}; aborted before attention read it")
        index, expected_page, expected_tag, page, tag = mismatches[0]
        return (f"KV integrity: request {r.request_id}, logical page {index}: expected physical page {expected_page} "
                f"tag {expected_tag}, found page {page} tag {tag}; aborted before attention read it")


class NullTracker:
    """integrity=False: the tracker's interface doing nothing — no tensors, no records, counters stay zero."""
    enabled = False
    checked = mismatched = aborted = 0

    def on_allocate(self, pages: list[int], request: Request | None = None) -> None:
        pass

    def owned_pages(self, request: Request) -> list[int]:
        return request.page_table

    def check(self, requests: list[Request], batch: ForwardBatch) -> dict[int, str]:
        return {}


def make_tracker(enabled: bool, num_pages: int, device: torch.device) -> IntegrityTracker | NullTracker:
    return IntegrityTracker(num_pages, device) if enabled else NullTracker()


# ---- faults, injected on purpose -----------------------------------------------------------------------------
# Each reproduces a real bug class by breaking the engine's bookkeeping directly, as a buggy scheduler would.

FAULT_KINDS = {
    "corrupt-page-table": "one entry of a running request's page table is overwritten with another live "
                          "request's page",
    "use-after-free": "a running request's page is freed early; the next admitted request is given it",
    "double-alloc": "a page a running request still holds is handed to the next admitted request as well",
    "stale-tag": "a running request's page is freed early and reallocated without bumping its tag",
    "kv-bitflip": "the sign bit of every value in one of a running request's pages is flipped",
}
# which faults the tags can see: stale-tag shows why the bump matters, kv-bitflip that tags guard the mapping only
DETECTABLE = {"corrupt-page-table", "use-after-free", "double-alloc"}


@dataclass
class Injection:
    kind: str
    victim: int       # the request whose reads go wrong
    page: int         # the physical page involved
    detail: str       # one line: what exactly was done


def inject(kind: str, engine: Engine, rng: random.Random) -> Injection:
    """Break the engine's state in the way `kind` names, choosing the victim (a decoding request) and its page
    with `rng`. The faults that free or hand out a page put it at the front of the free list (a LIFO bug), so the
    next allocation — a newly admitted request — receives it."""
    decoding = sorted((r for r in engine.running if r.page_table and r.num_tokens - r.num_cached == 1),
                      key=lambda r: r.request_id)
    if not decoding or (kind == "corrupt-page-table" and len(decoding) < 2):
        raise RuntimeError(f"{kind}: no running request to inject into")
    victim = rng.choice(decoding)
    index = rng.randrange(len(victim.page_table))
    page = victim.page_table[index]
    allocator, tracker = engine.allocator, engine.integrity
    if kind == "corrupt-page-table":
        other = rng.choice([r for r in decoding if r is not victim])
        foreign = rng.choice(other.page_table)
        victim.page_table[index] = foreign
        return Injection(kind, victim.request_id, foreign,
                         f"request {victim.request_id}'s logical page {index} now points at physical page {foreign} "
                         f"(request {other.request_id}'s) instead of {page}")
    if kind in ("use-after-free", "stale-tag", "double-alloc"):
        allocator.free.appendleft(page)
        if kind != "double-alloc":    # freed: the allocator's books say nobody owns it
            allocator.is_free[page] = True
        if kind == "stale-tag" and tracker.enabled:   # undo the bump the coming reallocation will make
            tracker.host_tags[page] -= 1
            tracker.page_tags[page] -= 1
        what = {"use-after-free": "freed while the request still decodes",
                "stale-tag": "freed while the request still decodes, to be reallocated without a tag bump",
                "double-alloc": "put back on the free list while the request still holds it"}[kind]
        return Injection(kind, victim.request_id, page,
                         f"physical page {page} (request {victim.request_id}'s logical page {index}) {what}; "
                         f"the next admitted request gets it")
    if kind == "kv-bitflip":
        values = engine.pool.kv[:, page]                                            # [L, page_size, C + R]
        bits = values.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[values.element_size()])
        bits ^= torch.iinfo(bits.dtype).min                                        # the sign bit
        return Injection(kind, victim.request_id, page,
                         f"flipped the sign bit of all {values.numel():,} KV values in physical page {page} "
                         f"(request {victim.request_id}'s logical page {index})")
    raise ValueError(f"unknown fault {kind!r}; one of {', '.join(FAULT_KINDS)}")


# ---- fault trials: a golden run, then the same run with a fault injected mid-decode ----------------------------

@dataclass
class FaultScenario:
    """A batch that starts together, a newcomer admitted right after the fault, greedy decoding."""
    prompts: list[list[int]]
    newcomer: list[int]
    max_tokens: int
    inject_step: int       # the fault is injected (and the newcomer added) after this many engine steps

    @classmethod
    def random(cls, vocab_size: int, seed: int, requests: int = 6, prompt_len: int = 40, max_tokens: int = 12,
               inject_step: int = 4) -> FaultScenario:
        rng = random.Random(seed)
        prompt = lambda: [rng.randrange(vocab_size) for _ in range(rng.randint(prompt_len // 2, prompt_len))]
        return cls([prompt() for _ in range(requests)], prompt(), max_tokens, inject_step)


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
    """Run the scenario on a fresh engine, injecting `kind` (if any) after `inject_step` steps; compare with the
    golden outputs when given."""
    from nano.sampling import SamplingParams
    params = SamplingParams(max_tokens=scenario.max_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.add(p, params, len(p) + scenario.max_tokens) for p in scenario.prompts]
    injection, steps = None, 0
    while engine.has_work() or len(requests) == len(scenario.prompts):
        if steps == scenario.inject_step and len(requests) == len(scenario.prompts):
            if kind is not None:
                injection = inject(kind, engine, rng or random.Random(0))
            requests.append(engine.add(scenario.newcomer, params, len(scenario.newcomer) + scenario.max_tokens))
        engine.step()
        steps += 1
    outputs = [r.output_token_ids for r in requests]
    errors = {i: r.error or "" for i, r in enumerate(requests) if r.finish_reason == "abort"}
    index = {r.request_id: i for i, r in enumerate(requests)}
    victim = index[injection.victim] if injection else None
    detected = victim in errors and errors[victim].startswith("KV integrity")
    silent_wrong = [] if golden is None else [i for i, out in enumerate(outputs)
                                              if i not in errors and out != golden[i]]
    false_positive = [i for i, e in errors.items() if i != victim and e.startswith("KV integrity")]
    return TrialOutcome(injection, outputs, errors, victim, detected, silent_wrong, false_positive)
