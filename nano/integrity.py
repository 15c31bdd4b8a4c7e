"""KV page integrity: a tag on every physical page, the expected (page, tag) pairs in every request, and one
batched check per step. (The faults it exists to catch are injected by `nano fault`, in cli/faults.py.)

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
  * a mismatch aborts that request only, before anything reads (or writes) the wrong page; the pass is then built
    from the tables just checked, so the slots the model writes and the tables it reads are the checked ones;
  * pages shared through the prefix cache keep their tag (nobody reallocated them): a request that takes a
    cached page records the tag the cache entry recorded when the page was filled, so a page evicted and handed
    to someone else under a request that still lists it is caught by the same check, and a cache entry whose
    page was reallocated is refused when it is looked up (`first_stale`).

Tags protect the *mapping* (which allocation a request reads), not the bytes inside a page. For the pages where
changed bytes would spread furthest, full pages in the prefix cache (shared by every request with that prefix, and
never written again), a checksum of their bytes is taken when they are cached (`on_cache`) and compared when a
request takes the hit (`first_corrupt`): a page whose bytes changed meanwhile is refused like a stale entry. A bit
flip anywhere else (a private page, or a cached page changed after a request took it) is invisible.
`NullTracker` (integrity=False) keeps the interface and does no work at all.
"""
from __future__ import annotations

from typing import Protocol

import torch

from nano.kv import KVPool


class PageHolder(Protocol):
    """What the tracker reads and writes of a request: its page table and the (page, tag) pairs it was given."""
    request_id: int
    page_table: list[int]
    expected_pages: list[int]
    expected_tags: list[int]


class IntegrityTracker:
    enabled = True
    chunk_bytes = 2**26   # pages checksummed at a time: 64 MiB of them

    def __init__(self, pool: KVPool) -> None:
        self.pool, device = pool, pool.kv.device
        self.page_tags = torch.zeros(pool.num_pages, dtype=torch.int64, device=device)   # [P] each page's current tag
        self.host_tags = [0] * pool.num_pages   # the same counters on the host: recording a tag costs no device sync
        # [P] each cached page's checksum, taken when it was cached; it belongs to the page's allocation then, and is
        # read only after that entry's tag matched (a page that left the cache was reallocated: its tag moved on)
        self.page_sums = torch.zeros(pool.num_pages, dtype=torch.int64, device=device)
        seed = torch.Generator().manual_seed(0x5EED)   # fixed odd int64 weights, one per word of a page, per pool part
        self.parts = [data for data in pool.parts().values() if data.numel()]   # no indexer: an empty index part
        self.weights = [(torch.randint(-2**62, 2**62, _words(data)[:, :1].shape, generator=seed) * 2 + 1).to(device)
                        for data in self.parts]   # each [layers, 1, page_size, words] ([layers, 1, S])
        self.checked = 0      # request rows checked (one per scheduled request per step)
        self.mismatched = 0   # page-table entries whose page or tag differed from the record
        self.aborted = 0      # requests aborted because of a mismatch

    def reset_counters(self) -> None:
        self.checked = self.mismatched = self.aborted = 0

    def on_allocate(self, pages: list[int], request: PageHolder | None = None) -> None:
        """Bump the tags of freshly allocated pages; record (page, new tag) in the request that receives them."""
        if not pages:
            return
        for page in pages:
            self.host_tags[page] += 1
        self.page_tags[self._index(pages)] += 1
        if request is not None:
            request.expected_pages += pages
            request.expected_tags += [self.host_tags[page] for page in pages]

    def on_share(self, pages: list[int], tags: list[int], request: PageHolder) -> None:
        """Record cached pages a request takes (a prefix-cache hit) with the tags they were cached with. No bump:
        the allocation that wrote them is the one it reads, shared, until the page is reallocated."""
        request.expected_pages += pages
        request.expected_tags += tags

    def first_stale(self, pages: list[int], tags: list[int]) -> int:
        """The index of the first page whose tag is no longer the one recorded with it (it was reallocated since:
        a stale prefix-cache entry), or len(pages) when every page still carries its tag."""
        return self._first_wrong([self.host_tags[page] != tag for page, tag in zip(pages, tags)])

    def checksums(self, pages: list[int]) -> torch.Tensor:
        """[n] int64: each page's bytes in every part and layer of the pool as 64-bit words w, summed as
        sum(w * weight) mod 2^64. A change inside one word (one byte, or all eight) changes it by d != 0 mod 2^64,
        and the sum by d * weight, never 0 mod 2^64 (the weight is odd: multiplying by it is a bijection mod 2^64):
        always caught. Changes in several words cancel out only by chance (about 2^-64 with these weights). Any
        dtype: only the bytes are read. Pages go through `chunk_bytes` at a time, so the one temporary (a copy of
        their words, multiplied in place) stays bounded."""
        index, chunk = self._index(pages), max(1, self.chunk_bytes * self.pool.num_pages // self.pool.nbytes)
        sums = [self._sum_chunk(index[i:i + chunk]) for i in range(0, len(pages), chunk)]
        return torch.cat(sums) if sums else index   # no pages: an empty [0]

    def _sum_chunk(self, index: torch.Tensor) -> torch.Tensor:
        sums = torch.zeros(len(index), dtype=torch.int64, device=index.device)
        for data, weights in zip(self.parts, self.weights):
            words = _words(data).index_select(1, index).long()   # [layers, n, page_size, words] ([layers, n, S])
            sums += words.mul_(weights).sum([0, *range(2, words.dim())])   # in place; int64 wraps: mod 2^64
        return sums

    def on_cache(self, pages: list[int]) -> None:
        """Full pages enter the prefix cache: record their checksums (their bytes are final; nothing writes them)."""
        if pages:
            self.page_sums[self._index(pages)] = self.checksums(pages)

    def first_corrupt(self, pages: list[int]) -> int:
        """The index of the first cached page whose bytes no longer give the checksum taken when it was cached
        (changed since: no request may take it), or len(pages). One host sync, on a hit only."""
        changed = (self.checksums(pages) != self.page_sums[self._index(pages)]).tolist() if pages else []
        return self._first_wrong(changed)

    def _first_wrong(self, wrong: list[bool]) -> int:
        """The index of the first page found wrong (counted as one mismatch), or len(wrong) when none is."""
        self.mismatched += any(wrong)
        return wrong.index(True) if any(wrong) else len(wrong)

    def _index(self, pages: list[int]) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.int64, device=self.page_tags.device)

    def owned_pages(self, request: PageHolder) -> list[int]:
        """The pages a request may give back: the ones it was given whose tag has not changed since. A page that
        was reallocated under it (a bug elsewhere) belongs to its new owner and must not be freed again."""
        return [p for p, tag in zip(request.expected_pages, request.expected_tags) if self.host_tags[p] == tag]

    def check(self, requests: list[PageHolder]) -> dict[int, str]:
        """Compare each scheduled request's page table with what it was given, all at once, before the pass is
        built (from these tables) and run. Returns {i: error} for every request whose table or tags differ."""
        flagged = {i: self._describe(r) for i, r in enumerate(requests) if len(r.page_table) != len(r.expected_pages)}
        width = max(len(r.page_table) for r in requests)
        self.checked += len(requests)
        if width:
            device = self.page_tags.device
            pad = lambda rows: torch.tensor([row[:width] + [0] * (width - len(row)) for row in rows], device=device)
            used = pad([r.page_table for r in requests])                                  # [B, W]
            lengths = torch.tensor([min(len(r.page_table), len(r.expected_pages)) for r in requests], device=device)
            valid = torch.arange(width, device=device) < lengths[:, None]                 # [B, W] real entries
            found_tags = self.page_tags[used.clamp(0, len(self.host_tags) - 1)]
            wrong = ((used != pad([r.expected_pages for r in requests]))
                     | (found_tags != pad([r.expected_tags for r in requests]))) & valid                 # [B, W]
            for i in wrong.any(1).nonzero().flatten().tolist():   # the one host sync of a clean check
                flagged.setdefault(i, self._describe(requests[i]))
        self.mismatched += sum(max(1, len(self._mismatches(requests[i]))) for i in flagged)   # a wrong length: 1
        self.aborted += len(flagged)
        return flagged

    def verify_pages(self, pages: list[int], tags: list[int]) -> bool:
        """A writer outside a step (a transfer landing) presents the pages and tags it writes to: True when each
        page still carries the writer's tag (nobody was given the page since)."""
        self.checked += 1
        valid = len(pages) == len(tags) and all(0 <= page < len(self.host_tags) and self.host_tags[page] == tag
                                                for page, tag in zip(pages, tags))
        self.mismatched += not valid
        return valid

    def verify(self, r: PageHolder) -> str | None:
        """The same check for one request outside a step (a transfer about to read its pages): the error, or
        None when its page table is exactly what it was given."""
        return self.check([r]).get(0)

    def _mismatches(self, r: PageHolder) -> list[tuple[int, int, int, int, int]]:
        """(index, expected page, expected tag, found page, found tag) for each entry that differs (slow path)."""
        found_tags = self.page_tags[self._index(r.page_table)].tolist()
        return [(i, expected_page, expected_tag, page, tag)
                for i, (expected_page, expected_tag, page, tag)
                in enumerate(zip(r.expected_pages, r.expected_tags, r.page_table, found_tags))
                if (page, tag) != (expected_page, expected_tag)]

    def _describe(self, r: PageHolder) -> str:
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

    def reset_counters(self) -> None:
        pass

    def on_allocate(self, pages: list[int], request: PageHolder | None = None) -> None:
        pass

    def on_share(self, pages: list[int], tags: list[int], request: PageHolder) -> None:
        pass

    def first_stale(self, pages: list[int], tags: list[int]) -> int:
        return len(pages)

    def on_cache(self, pages: list[int]) -> None:
        pass

    def first_corrupt(self, pages: list[int]) -> int:
        return len(pages)

    def owned_pages(self, request: PageHolder) -> list[int]:
        return request.page_table

    def check(self, requests: list[PageHolder]) -> dict[int, str]:
        return {}

    def verify(self, r: PageHolder) -> str | None:
        return None

    def verify_pages(self, pages: list[int], tags: list[int]) -> bool:
        return True


def _words(values: torch.Tensor) -> torch.Tensor:
    """values [..., D], any dtype -> their bytes as integers [..., D * size / width]: int64 words (int32, int16 or
    uint8 where a row's bytes do not divide by 8). A view: no copy."""
    row = values.shape[-1] * values.element_size()
    return values.view(next(t for t in (torch.int64, torch.int32, torch.int16, torch.uint8) if row % t.itemsize == 0))


def make_tracker(enabled: bool, pool: KVPool) -> IntegrityTracker | NullTracker:
    return IntegrityTracker(pool) if enabled else NullTracker()
