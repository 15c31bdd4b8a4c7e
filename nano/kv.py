"""The paged KV cache: one pool of fixed-size pages shared by every request, and the allocator that hands them out.

A page holds `page_size` consecutive tokens of one request, for every layer: the MLA latent and rope key
(C + R = 576 values per token per layer for Kimi and GLM-5) and, on GLM-5's indexer layers, the DSA indexer key.
A request's *page table* lists its pages in order, so token t lives in page_table[t // page_size] at offset
t % page_size. Pages need not be contiguous or in any order in the pool.

FP8 (e4m3) pages hold a token's latent ‖ rope key in one of three layouts (`kv_layout`), as engines do:

    token   [C + R] e4m3 and one fp32 scale per token per layer (amax / 448): 580 B. nano's own.
    tensor  [C + R] e4m3 and one scale for the whole layer, fixed at 1 (the stored value is the value): 576 B, 2.0x
            BF16's tokens. SGLang's and vLLM's FP8 MLA cache with no calibrated scale in the checkpoint.
    tile    latent [C] e4m3 with a power-of-two fp32 scale per quarter (128 values for C = 512), rope key [R] in
            BF16: 512 + 16 + 128 = 656 B. FlashMLA's FP8 cache for DeepSeek-V3.2-style sparse attention (GLM-5's DSA).

The FP8 indexer key has one scale per token in every layout (Di + 4 B). Attention folds a per-token scale into
the scores and the probabilities; the other layouts are dequantized as they are gathered.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

import torch

from nano.config import TILES, ModelConfig
from nano.errors import NanoError
from nano.quant import FP8_MAX, e4m3_bits
from nano.settings import KV_DTYPES, KV_LAYOUTS, free_memory

# each KV dtype as torch stores it
STORAGE_DTYPES = dict(zip(KV_DTYPES, (torch.float32, torch.bfloat16, torch.float8_e4m3fn), strict=True))


def quantize_fp8(values: torch.Tensor, tile: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., N, D] -> (e4m3 codes [..., N, D], fp32 scales): true value = code * scale. Without `tile`
    one scale per token [..., N] (amax / 448); with it one power-of-two scale per `tile` values [..., N, D / tile]
    (2^ceil(log2(amax / 448)): dividing by it is exact, and the largest code stays within 448)."""
    values = values.float()
    if tile is None:
        scale = values.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
        return (values / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(STORAGE_DTYPES["fp8"]), scale
    tiles = values.unflatten(-1, (-1, tile))                                            # [..., N, D / tile, tile]
    scale = torch.exp2(torch.ceil(torch.log2(tiles.abs().amax(-1).clamp(min=2.0**-100) / FP8_MAX)))
    codes = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(STORAGE_DTYPES["fp8"])
    return codes.flatten(-2), scale


def check_format(kv_dtype: str, kv_layout: str) -> None:
    if kv_dtype not in KV_DTYPES or kv_layout not in KV_LAYOUTS:
        raise NanoError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} and kv_layout one of "
                        f"{', '.join(KV_LAYOUTS)}, got {kv_dtype!r}, {kv_layout!r}")


def part_shapes(cfg: ModelConfig, kv_dtype: str, kv_layout: str, num_tokens: int
                ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of each part of `num_tokens` tokens in a pool of this dtype and layout, token-major: what
    `KVPool.export_tokens` gives, and what a receiver of another pool's export expects."""
    layers, index_layers = cfg.num_hidden_layers, len(cfg.indexer_layers)
    c, r, dtype = cfg.kv_lora_rank, cfg.qk_rope_head_dim, STORAGE_DTYPES[kv_dtype]
    layout = kv_layout if kv_dtype == "fp8" else "plain"
    kv = {"plain": {"kv": (dtype, (c + r,))},
          "token": {"kv": (dtype, (c + r,)), "kv_scale": (torch.float32, ())},
          "tensor": {"kv": (dtype, (c + r,))},
          "tile": {"kv": (dtype, (c,)), "kv_scale": (torch.float32, (TILES,)),
                   "rope": (torch.bfloat16, (r,))}}[layout]
    index = {"index": (dtype, (cfg.index_head_dim,)),
             **({"index_scale": (torch.float32, ())} if kv_dtype == "fp8" else {})}
    return {**{name: (dt, (layers, num_tokens, *shape)) for name, (dt, shape) in kv.items()},
            **{name: (dt, (index_layers, num_tokens, *shape)) for name, (dt, shape) in index.items()}}


class KVPool:
    """Every layer's KV for every request, as `num_pages` pages of `page_size` tokens (`part_shapes` by name):

    kv     [L, P, page_size, C + R]    latent | rope key in the storage dtype (FP8 tile: the latent [C] only)
    kv_scale [L, P, page_size(, 4)]    FP8 token: a scale per token; tile: per quarter of the latent (else absent)
    rope   [L, P, page_size, R] bf16   FP8 tile only: the rope key, kept in BF16
    index  [L_idx, P, page_size, Di]   GLM-5 indexer keys (only layers that run the indexer), same dtype
    index_scale [L_idx, P, page_size]  FP8 only
    True value = stored * scale; FP8 tensor pages store the value itself (a layer scale fixed at 1).
    """

    def __init__(self, cfg: ModelConfig, kv_dtype: str, num_pages: int, page_size: int,
                 device: torch.device | str = "cpu", kv_layout: str = "token") -> None:
        check_format(kv_dtype, kv_layout)
        if page_size < 1 or num_pages < 1:
            raise NanoError(f"page_size and the page count must be >= 1 (got {page_size}, {num_pages})")
        self.cfg, self.kv_dtype, self.num_pages, self.page_size = cfg, kv_dtype, num_pages, page_size
        self.dtype, self.fp8 = STORAGE_DTYPES[kv_dtype], kv_dtype == "fp8"
        self.kv_layout = kv_layout if self.fp8 else "token"
        if self.kv_layout == "tile" and cfg.kv_lora_rank % TILES:
            raise NanoError(f"the tile layout scales the latent in {TILES} tiles; this model's latent has "
                            f"{cfg.kv_lora_rank} values")
        self.index_slot = {layer: i for i, layer in enumerate(cfg.indexer_layers)}
        self.data = {name: torch.zeros(shape[0], num_pages, page_size, *shape[2:], dtype=dtype, device=device)
                     for name, (dtype, shape) in part_shapes(cfg, kv_dtype, self.kv_layout, 0).items()}
        self.kv, self.index = self.data["kv"], self.data["index"]

    @classmethod
    def from_budget(cls, cfg: ModelConfig, kv_dtype: str, kv_budget: int, page_size: int,
                    device: torch.device | str = "cpu", kv_layout: str = "token") -> "KVPool":
        """As many pages as `kv_budget` bytes hold in this dtype and layout."""
        check_format(kv_dtype, kv_layout)
        page_bytes = cfg.kv_bytes_per_token(kv_dtype, kv_layout) * page_size
        num_pages = kv_budget // page_bytes
        if num_pages < 1:
            raise NanoError(f"kv_budget {kv_budget:,} B holds no page of {page_size} tokens ({page_bytes:,} B each)")
        free = free_memory(torch.device(device))
        if num_pages * page_bytes > free:   # refused before a byte is allocated
            raise NanoError(f"kv_budget {kv_budget / 2**30:.1f} GiB is more than the free memory on "
                            f"{torch.device(device).type} ({free / 2**30:.1f} GiB)")
        return cls(cfg, kv_dtype, num_pages, page_size, device, kv_layout)

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def format(self) -> str:
        """'bf16', 'fp8 (tile layout)': what the pages hold."""
        return self.kv_dtype + (f" ({self.kv_layout} layout)" if self.fp8 else "")

    @property
    def nbytes(self) -> int:
        return self.tokens * self.cfg.kv_bytes_per_token(self.kv_dtype, self.kv_layout)

    # ---- writing: slots are flat token addresses page * page_size + offset ---------------------------------
    def slots(self, page_table: list[int], start: int, count: int) -> list[int]:
        """Flat addresses of tokens start .. start + count - 1 of a sequence with this page table."""
        size = self.page_size
        return [page_table[t // size] * size + t % size for t in range(start, start + count)]

    def encode(self, values: torch.Tensor, index: bool = False) -> dict[str, torch.Tensor]:
        """Values [..., N, C + R] (or indexer keys [..., N, Di]) -> the parts this pool stores for them."""
        name = "index" if index else "kv"
        if not self.fp8:
            return {name: values.to(self.dtype)}
        if index or self.kv_layout == "token":
            codes, scale = quantize_fp8(values)
            return {name: codes, f"{name}_scale": scale}
        if self.kv_layout == "tensor":
            return {"kv": values.float().clamp(-FP8_MAX, FP8_MAX).to(self.dtype)}
        rank = self.cfg.kv_lora_rank                                                    # tile: latent | rope
        codes, scale = quantize_fp8(values[..., :rank], rank // TILES)
        return {"kv": codes, "kv_scale": scale, "rope": values[..., rank:].to(torch.bfloat16)}

    def decode(self, parts: dict[str, torch.Tensor], index: bool = False) -> torch.Tensor:
        """`encode`'s parts (any leading shape) -> float32 values [..., N, C + R] (or keys [..., N, Di])."""
        name = "index" if index else "kv"
        values = parts[name].float()
        if "rope" in parts and not index:                                               # tile
            latent = values.unflatten(-1, (TILES, -1)) * parts["kv_scale"][..., None]
            return torch.cat([latent.flatten(-2), parts["rope"].float()], -1)
        return values * parts[f"{name}_scale"][..., None] if f"{name}_scale" in parts else values

    def _store(self, encoded: dict[str, torch.Tensor], i: int, slots: torch.Tensor) -> None:
        """Write encoded parts [N, ...] at `slots` [N] of layer (or indexer layer) `i`."""
        for name, values in encoded.items():
            self.data[name][i].view(-1, *self.data[name].shape[3:])[slots] = values    # [P * page_size, ...]

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        """Store the new tokens' latent [N, C] and rope key [N, R] at `slots` [N]."""
        self._store(self.encode(torch.cat([latent, rope_key], -1)), layer, slots)

    def write_index(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        self._store(self.encode(keys, index=True), self.index_slot[layer], slots)

    # ---- moving a sequence between pools (disaggregated prefill -> decode) -----------------------------------
    def parts(self) -> dict[str, torch.Tensor]:
        """The pool's tensors by name, each [layers, P, page_size, ...]: what a sequence's export is made of."""
        return self.data

    def token_shapes(self, num_tokens: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of each part `export_tokens` gives for `num_tokens` tokens."""
        return part_shapes(self.cfg, self.kv_dtype, self.kv_layout, num_tokens)

    def export_tokens(self, page_table: list[int], num_tokens: int, out: dict[str, torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
        """A sequence's first `num_tokens` tokens, token-major in the storage format — only what it needs, not
        whole pages: each part [layers, T, ...] (`token_shapes`). `out` (tensors of `token_shapes`, e.g. views of
        a staging buffer) receives them without another copy."""
        out = out if out is not None else {name: torch.empty(shape, dtype=dtype, device=self.kv.device)
                                           for name, (dtype, shape) in self.token_shapes(num_tokens).items()}
        for name, data in self.parts().items():
            for page, token, count in self._runs(page_table, num_tokens):
                out[name][:, token:token + count].copy_(data[:, page:].flatten(1, 2)[:, :count])
        return out

    def import_tokens(self, page_table: list[int], parts: dict[str, torch.Tensor]) -> None:
        """Write what `export_tokens` produced, from a pool of any KV dtype and layout, into this pool's pages. The
        same format copies the bytes as they are (FP8 with its scales: exact); another converts all layers at
        once, to what `write` would have stored."""
        num_tokens = parts["kv"].shape[1]
        own = self.token_shapes(num_tokens)
        if {name: (part.dtype, tuple(part.shape)) for name, part in parts.items()} != own:
            parts = {**self.encode(self.decode(parts).to(self.kv.device)),
                     **self.encode(self.decode(parts, index=True).to(self.kv.device), index=True)}
        for name, data in self.parts().items():
            for page, token, count in self._runs(page_table, num_tokens):
                data[:, page:].flatten(1, 2)[:, :count].copy_(parts[name][:, token:token + count])

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
    def _gathered(self, names: tuple[str, ...], i: int, page_table: torch.Tensor) -> dict[str, torch.Tensor]:
        """Layer i of each part by page_table [B, pages] -> [B, S_max, ...]."""
        batch, pages = page_table.shape
        return {name: self.data[name][i][page_table].view(batch, pages * self.page_size, *self.data[name].shape[3:])
                for name in names if name in self.data}

    def gather(self, layer: int, page_table: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """page_table [B, pages] -> (kv [B, S_max, C + R] in `dtype`, and for FP8 token and tensor pages the per-token
        scale [B, S_max] that `attend` folds into the scores and probabilities; else None: the values are the true
        ones)."""
        parts = self._gathered(("kv", "kv_scale", "rope"), layer, page_table)
        values = parts["kv"]
        if not self.fp8:
            return values.to(dtype), None
        # e4m3 -> float16 by integer ops, exact (value * 2^-8: the 256 goes into the scale), then to `dtype`
        values = e4m3_bits(values, torch.float16).to(dtype)
        if self.kv_layout == "token":
            return values, parts["kv_scale"] * 256.0
        if self.kv_layout == "tensor":   # scale 1: only the shift, folded into attention like a token scale
            return values, values.new_full(values.shape[:2], 256.0, dtype=torch.float32)
        latent = values.unflatten(-1, (TILES, -1)) * (parts["kv_scale"] * 256.0).to(dtype)[..., None]
        return torch.cat([latent.flatten(-2), parts["rope"].to(dtype)], -1), None       # [B, S_max, C + R]

    def gather_index(self, layer: int, page_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized indexer keys [B, pages * page_size, Di]."""
        parts = self._gathered(("index", "index_scale"), self.index_slot[layer], page_table)
        if not self.fp8:
            return parts["index"].to(dtype)
        return e4m3_bits(parts["index"], torch.float16).to(dtype) * (parts["index_scale"] * 256.0).to(dtype)[..., None]


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
