"""The paged KV cache: one pool of fixed-size pages shared by every request, and the allocator that hands them out.

A page holds `page_size` consecutive tokens of one request, for every layer: the MLA latent and rope key
(C + R = 576 values per token per layer for Kimi and GLM-5) and, on GLM-5's indexer layers, the DSA indexer key.
A request's *page table* lists its pages in order, so token t lives in page_table[t // page_size] at offset
t % page_size. Pages need not be contiguous or in any order in the pool.

FP8 (e4m3) pages store each token's vector scaled into [-448, 448] with one fp32 scale per token per layer:
576 + 4 bytes instead of 1152, so the same bytes hold 1.986x the tokens. Attention folds the scale into the
scores and the probabilities instead of dequantizing the cache in a separate pass.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

import torch

from nano.config import ModelConfig
from nano.errors import NanoError
from nano.quant import FP8_MAX, e4m3_bits
from nano.settings import KV_DTYPES, free_memory

# each KV dtype as torch stores it
STORAGE_DTYPES = dict(zip(KV_DTYPES, (torch.float32, torch.bfloat16, torch.float8_e4m3fn), strict=True))


def quantize_fp8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., N, D] -> (e4m3 values [..., N, D], fp32 scale per token [..., N]): true value = stored * scale."""
    values = values.float()
    scale = values.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (values / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(STORAGE_DTYPES["fp8"]), scale


class KVPool:
    """Every layer's KV for every request, as `num_pages` pages of `page_size` tokens.

    kv     [L, P, page_size, C + R]    latent | rope key, in the storage dtype
    scale  [L, P, page_size] fp32      FP8 only: true value = stored * scale
    index  [L_idx, P, page_size, Di]   GLM-5 indexer keys (only layers that run the indexer), same dtype
    index_scale [L_idx, P, page_size]  FP8 only
    """

    def __init__(self, cfg: ModelConfig, kv_dtype: str, num_pages: int, page_size: int,
                 device: torch.device | str = "cpu") -> None:
        if kv_dtype not in KV_DTYPES:
            raise NanoError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        if page_size < 1 or num_pages < 1:
            raise NanoError(f"page_size and the page count must be >= 1 (got {page_size}, {num_pages})")
        self.cfg, self.kv_dtype, self.num_pages, self.page_size = cfg, kv_dtype, num_pages, page_size
        self.dtype, self.fp8 = STORAGE_DTYPES[kv_dtype], kv_dtype == "fp8"
        layers, index_layers = cfg.num_hidden_layers, len(cfg.indexer_layers)
        self.index_slot = {layer: i for i, layer in enumerate(cfg.indexer_layers)}
        pages = (num_pages, page_size)
        self.kv = torch.zeros(layers, *pages, cfg.kv_values_per_token_layer, dtype=self.dtype, device=device)
        self.index = torch.zeros(index_layers, *pages, cfg.index_head_dim, dtype=self.dtype, device=device)
        self.scale = torch.ones(layers, *pages, device=device) if self.fp8 else None
        self.index_scale = torch.ones(index_layers, *pages, device=device) if self.fp8 else None

    @classmethod
    def from_budget(cls, cfg: ModelConfig, kv_dtype: str, kv_budget: int, page_size: int,
                    device: torch.device | str = "cpu") -> "KVPool":
        """As many pages as `kv_budget` bytes hold in this dtype."""
        if kv_dtype not in KV_DTYPES:
            raise NanoError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        page_bytes = cfg.kv_bytes_per_token(kv_dtype) * page_size
        num_pages = kv_budget // page_bytes
        if num_pages < 1:
            raise NanoError(f"kv_budget {kv_budget:,} B holds no page of {page_size} tokens ({page_bytes:,} B each)")
        free = free_memory(torch.device(device))
        if num_pages * page_bytes > free:   # refused before a byte is allocated
            raise NanoError(f"kv_budget {kv_budget / 2**30:.1f} GiB is more than the free memory on "
                            f"{torch.device(device).type} ({free / 2**30:.1f} GiB)")
        return cls(cfg, kv_dtype, num_pages, page_size, device)

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.tokens * self.cfg.kv_bytes_per_token(self.kv_dtype)

    # ---- writing: slots are flat token addresses page * page_size + offset ---------------------------------
    def slots(self, page_table: list[int], start: int, count: int) -> list[int]:
        """Flat addresses of tokens start .. start + count - 1 of a sequence with this page table."""
        size = self.page_size
        return [page_table[t // size] * size + t % size for t in range(start, start + count)]

    def _store(self, values: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, i: int,
               slots: torch.Tensor) -> None:
        """Write values [N, D] at `slots` [N] of layer `i` of `data` (and, FP8, their scales into `scale`)."""
        flat = data[i].view(-1, data.shape[-1])                                         # [P * page_size, D]
        if scale is None:
            flat[slots] = values.to(self.dtype)
            return
        flat[slots], scale[i].view(-1)[slots] = quantize_fp8(values)

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        """Store the new tokens' latent [N, C] and rope key [N, R] at `slots` [N]."""
        self._store(torch.cat([latent, rope_key], -1), self.kv, self.scale, layer, slots)

    def write_index(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        self._store(keys, self.index, self.index_scale, self.index_slot[layer], slots)

    # ---- moving a sequence between pools (disaggregated prefill -> decode) -----------------------------------
    def parts(self) -> dict[str, torch.Tensor]:
        """The pool's tensors by name, each [layers, P, page_size, ...]: what a sequence's export is made of."""
        parts = {"kv": self.kv, "index": self.index}
        return {**parts, "kv_scale": self.scale, "index_scale": self.index_scale} if self.fp8 else parts

    def token_shapes(self, num_tokens: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of each part `export_tokens` gives for `num_tokens` tokens."""
        return {name: (data.dtype, (data.shape[0], num_tokens, *data.shape[3:]))
                for name, data in self.parts().items()}

    def export_tokens(self, page_table: list[int], num_tokens: int, out: dict[str, torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
        """A sequence's first `num_tokens` tokens, token-major in the storage dtype — only what it needs, not
        whole pages: kv [L, T, C + R], index [L_idx, T, Di], and with FP8 their scales [L, T], [L_idx, T].
        `out` (tensors of `token_shapes`, e.g. views of a staging buffer) receives them without another copy."""
        out = out if out is not None else {name: torch.empty(shape, dtype=dtype, device=self.kv.device)
                                           for name, (dtype, shape) in self.token_shapes(num_tokens).items()}
        for name, data in self.parts().items():
            for page, token, count in self._runs(page_table, num_tokens):
                out[name][:, token:token + count].copy_(data[:, page:].flatten(1, 2)[:, :count])
        return out

    def import_tokens(self, page_table: list[int], parts: dict[str, torch.Tensor]) -> None:
        """Write what `export_tokens` produced, from a pool of any KV dtype, into this pool's pages. The same dtype
        copies the bytes as they are (FP8 with its scales: exact); another dtype converts all layers at once,
        to what `write` would have stored."""
        num_tokens = parts["kv"].shape[1]
        if parts["kv"].dtype != self.dtype:
            parts = self._convert(parts)
        for name, data in self.parts().items():
            for page, token, count in self._runs(page_table, num_tokens):
                data[:, page:].flatten(1, 2)[:, :count].copy_(parts[name][:, token:token + count])

    def _convert(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        converted = {}
        for name in ("kv", "index"):
            values = parts[name].to(self.kv.device, torch.float32)                   # [layers, T, D]
            if f"{name}_scale" in parts:   # FP8 in: dequantize
                values *= parts[f"{name}_scale"].to(self.kv.device)[..., None]
            if self.fp8:
                converted[name], converted[f"{name}_scale"] = quantize_fp8(values)
            else:
                converted[name] = values.to(self.dtype)
        return converted

    def _runs(self, page_table: list[int], num_tokens: int) -> list[tuple[int, int, int]]:
        """(first page, first token, tokens) of each run of consecutive pages holding the sequence's first
        `num_tokens` tokens. Pages allocated together are mostly consecutive, so a sequence moves in a few block
        copies (a copy per token slot, `index_copy_`, runs ~6x slower on CPU)."""
        runs: list[list[int]] = []
        for i, page in enumerate(page_table[:-(-num_tokens // self.page_size)]):
            if runs and runs[-1][0] + runs[-1][2] // self.page_size == page:
                runs[-1][2] += self.page_size
            else:
                runs.append([page, i * self.page_size, self.page_size])
        return [(page, token, min(count, num_tokens - token)) for page, token, count in runs]

    # ---- reading: gather whole pages by page table ----------------------------------------------------------
    def _gather(self, data: torch.Tensor, scale: torch.Tensor | None, i: int, page_table: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i of `data` by page_table [B, pages] -> (values [B, S_max, D] in `dtype`, scale [B, S_max] or None)."""
        batch, pages = page_table.shape
        values = data[i][page_table].view(batch, pages * self.page_size, -1)             # [B, S_max, D]
        if scale is None:
            return values.to(dtype), None
        # e4m3 -> float16 by integer ops, exact (value * 2^-8: the 256 goes into the scale), then to `dtype`
        return e4m3_bits(values, torch.float16).to(dtype), scale[i][page_table].view(batch, -1) * 256.0

    def gather(self, layer: int, page_table: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """page_table [B, pages] -> (kv [B, pages * page_size, C + R] in `dtype`, per-token scale or None)."""
        return self._gather(self.kv, self.scale, layer, page_table, dtype)

    def gather_index(self, layer: int, page_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized indexer keys [B, pages * page_size, Di]."""
        keys, scale = self._gather(self.index, self.index_scale, self.index_slot[layer], page_table, dtype)
        return keys if scale is None else keys * scale[..., None].to(dtype)


@dataclass(frozen=True, slots=True)
class CachedPage:
    """One full page in the prefix cache: which tokens it holds, after which prefix, and the allocation it is."""
    key: int                  # hash((parent, tokens)): the whole prefix up to and including this page
    parent: int | None        # the key of the page before it in the sequence (None: the sequence's first page)
    tokens: tuple[int, ...]   # the page_size tokens whose KV the page holds
    page: int
    tag: int                  # the page's integrity tag when it was cached (0 with integrity off)


def page_key(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The prefix cache's key of a page: a hash chained over every page before it, so equal keys mean equal
    prefixes (a collision is caught by comparing `tokens` and `parent` on lookup)."""
    return hash((parent, tokens))


class PageAllocator:
    """Hands out pages of the pool and keeps the prefix cache: full pages of earlier sequences, found by a chain
    of page hashes and shared between requests whose tokens start the same way.

    A page is in exactly one of three states:
      free        on `free`, holding nothing anyone wants;
      evictable   in the cache, referenced by nobody (`evictable`, least recently released first);
      referenced  in one or more page tables (`refcount` > 0), cached or not.
    `allocate` takes free pages first, then evicts the least recently used evictable ones (dropping their cache
    entries); a referenced page is never handed out. `share` adds a reference to cached pages (a cache hit),
    `release` drops one; a page whose last reference goes becomes evictable if cached, free otherwise.

    Invariants (checked by `check`):
      * every page is in exactly one of the three states;
      * a page's refcount equals the number of page tables that hold it;
      * the cache holds only evictable or referenced pages, one entry per page, and a cached page's tokens are
        the tokens its key says: every sequence holding it has those tokens there, after the same prefix;
      * a sequence's page table has exactly ceil(tokens / page_size) pages for the tokens it has cached;
      * the free list is FIFO: a freed page goes to the back, so it is reused as late as possible (a stale
        reference to it keeps pointing at the old data for as long as the pool allows);
      * a reference is dropped at most once: releasing a page nobody references does nothing (counted in
        `double_frees`), so one bookkeeping bug cannot put a page on the free list twice.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free: deque[int] = deque(range(num_pages))
        self.refcount = [0] * num_pages
        self.evictable: OrderedDict[int, None] = OrderedDict()   # cached pages nobody references, LRU first
        self.cache: dict[int, CachedPage] = {}                   # key -> cached page
        self.cached_key: dict[int, int] = {}                     # page -> its key, for every cached page
        self.double_frees = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now: the free ones and the evictable ones."""
        return len(self.free) + len(self.evictable)

    @property
    def num_referenced(self) -> int:
        return self.num_pages - self.num_free

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages (free ones first, then the least recently used evictable ones, whose cache entries go),
        each with one reference; or None, and nothing taken, if there are too few."""
        if count > self.num_free:
            return None
        pages = []
        for _ in range(count):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.evictable.popitem(last=False)
                del self.cache[self.cached_key.pop(page)]
            self.refcount[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: list[int]) -> None:
        """One more reference to each of these cached pages (a cache hit)."""
        for page in pages:
            if self.refcount[page] == 0:
                del self.evictable[page]
            self.refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody references any more stays cached (evictable, most
        recently used) if it is in the cache, and goes to the back of the free list if not."""
        for page in pages:
            if self.refcount[page] == 0:
                self.double_frees += 1
                continue
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                if page in self.cached_key:
                    self.evictable[page] = None
                else:
                    self.free.append(page)

    # ---- the prefix cache ---------------------------------------------------------------------------------
    def lookup(self, token_ids: list[int], max_tokens: int, page_size: int) -> list[CachedPage]:
        """The cached pages holding the longest prefix of `token_ids` of at most `max_tokens` tokens, in whole
        pages, in order."""
        found: list[CachedPage] = []
        parent = None
        for start in range(0, max_tokens - page_size + 1, page_size):
            tokens = tuple(token_ids[start:start + page_size])
            entry = self.cache.get(page_key(parent, tokens))
            if entry is None or entry.tokens != tokens or entry.parent != parent:
                break
            found.append(entry)
            parent = entry.key
        return found

    def insert(self, page: int, parent: int | None, tokens: tuple[int, ...], tag: int) -> int:
        """Cache a referenced full page holding `tokens` after the prefix `parent`; returns its key. When that
        prefix is cached already (another sequence computed the same page), the page stays private."""
        key = page_key(parent, tokens)
        if key not in self.cache and page not in self.cached_key:
            self.cache[key] = CachedPage(key, parent, tokens, page, tag)
            self.cached_key[page] = key
        return key

    def forget(self, key: int) -> None:
        """Drop a cache entry (e.g. one found stale); its page, if nobody references it, becomes free."""
        entry = self.cache.pop(key)
        del self.cached_key[entry.page]
        if entry.page in self.evictable:
            del self.evictable[entry.page]
            self.free.append(entry.page)

    def clear_cache(self) -> None:
        """Forget every cached prefix."""
        for key in list(self.cache):
            self.forget(key)

    def check(self, page_tables: dict[int, list[int]], cached_tokens: dict[int, int], page_size: int,
              token_ids: dict[int, list[int]] | None = None) -> None:
        """Raise AssertionError if the invariants above do not hold for these sequences (id -> page table, tokens
        cached, and their token ids for the cache's token check)."""
        holders = Counter(page for table in page_tables.values() for page in table)
        free, evictable = set(self.free), set(self.evictable)
        assert len(free) == len(self.free), "a page is on the free list twice"
        for page in range(self.num_pages):
            assert holders[page] == self.refcount[page], \
                f"page {page} is in {holders[page]} page tables but its refcount is {self.refcount[page]}"
            states = (page in free, page in evictable, self.refcount[page] > 0)
            assert sum(states) == 1, f"page {page} is not in exactly one of free / evictable / referenced: {states}"
            assert (page in evictable) <= (page in self.cached_key), f"evictable page {page} is not cached"
            assert (page in free) <= (page not in self.cached_key), f"free page {page} is still cached"
        assert len(self.cache) == len(self.cached_key) and all(
            self.cached_key.get(entry.page) == key for key, entry in self.cache.items()), "cache entries disagree"
        for key, entry in self.cache.items():
            assert key == page_key(entry.parent, entry.tokens) and len(entry.tokens) == page_size, \
                f"cached page {entry.page}: its key is not its tokens' and prefix's"
        for sequence, table in page_tables.items():
            need = -(-cached_tokens[sequence] // page_size)
            assert len(table) == need, f"request {sequence} holds {len(table)} pages for {need} pages of tokens"
            if token_ids is None:
                continue
            parent = None   # the chain of keys of the sequence's own tokens: a cached page it holds must match
            for i, page in enumerate(table[:cached_tokens[sequence] // page_size]):
                parent = page_key(parent, tuple(token_ids[sequence][i * page_size:(i + 1) * page_size]))
                assert self.cached_key.get(page, parent) == parent, \
                    f"request {sequence}'s page {i} (physical {page}) is cached for other tokens than its own"
