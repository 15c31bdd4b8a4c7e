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

import os
import re
from collections import deque

import torch

from nano.config import ModelConfig
from nano.errors import NanoError
from nano.quant import FP8_MAX

KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(size: str | int) -> int:
    """'256MiB', '1.5GB', '4096' or an int -> bytes."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?i?[bB]?)\s*", size)
        if not match or match.group(2).lower() not in _UNITS:
            raise NanoError(f"cannot read the size {size!r}: use e.g. 256MiB, 2GiB or a number of bytes")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise NanoError(f"a size must be positive, got {size!r}")
    return value


def default_kv_budget(device: torch.device) -> int:
    """Half of the GPU memory left free once the weights are loaded; 256 MiB on CPU (the pool is zero-filled,
    so its bytes are really touched: ~13k tokens of a nano stand-in in fp32, ~200 per conversation is typical)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return 256 * 2**20


def free_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device`: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):   # not Linux: the physical memory is the best bound known
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def quantize_fp8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., N, D] -> (e4m3 values [..., N, D], fp32 scale per token [..., N]): true value = stored * scale."""
    values = values.float()
    scale = values.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (values / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(KV_DTYPES["fp8"]), scale


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
        self.dtype, self.fp8 = KV_DTYPES[kv_dtype], kv_dtype == "fp8"
        layers, index_layers = cfg.num_hidden_layers, len(cfg.indexer_layers)
        self.index_slot = {layer: i for i, layer in enumerate(cfg.indexer_layers)}
        # one more page than the allocator hands out: the scratch page, where the integrity guard sends writes and
        # reads that are not their request's (never read as anyone's KV)
        self.scratch_page = num_pages
        self.kv = torch.zeros(layers, num_pages + 1, page_size, cfg.kv_values_per_token_layer,
                              dtype=self.dtype, device=device)
        self.index = torch.zeros(index_layers, num_pages + 1, page_size, cfg.index_head_dim, dtype=self.dtype,
                                 device=device)
        self.scale = torch.ones(layers, num_pages + 1, page_size, device=device) if self.fp8 else None
        self.index_scale = torch.ones(index_layers, num_pages + 1, page_size, device=device) if self.fp8 else None

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
        if (num_pages + 1) * page_bytes > free:   # refused before a byte is allocated (+1: the scratch page)
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

    def _store(self, values: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None,
               slots: torch.Tensor) -> None:
        flat = data.view(-1, data.shape[-1])                                            # [P * page_size, D]
        if scale is None:
            flat[slots] = values.to(self.dtype)
            return
        flat[slots], scale.view(-1)[slots] = quantize_fp8(values)

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        """Store the new tokens' latent [N, C] and rope key [N, R] at `slots` [N]."""
        self._store(torch.cat([latent, rope_key], -1), self.kv[layer],
                    None if self.scale is None else self.scale[layer], slots)

    def write_index(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        i = self.index_slot[layer]
        self._store(keys, self.index[i], None if self.index_scale is None else self.index_scale[i], slots)

    # ---- moving a sequence between pools (disaggregated prefill -> decode) -----------------------------------
    def _parts(self) -> dict[str, torch.Tensor]:
        """The pool's tensors by name, each [layers, P, page_size, ...]: what a sequence's export is made of."""
        parts = {"kv": self.kv, "index": self.index}
        return {**parts, "kv_scale": self.scale, "index_scale": self.index_scale} if self.fp8 else parts

    def token_shapes(self, num_tokens: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of each part `export_tokens` gives for `num_tokens` tokens."""
        return {name: (data.dtype, (data.shape[0], num_tokens, *data.shape[3:]))
                for name, data in self._parts().items()}

    def export_tokens(self, page_table: list[int], num_tokens: int, out: dict[str, torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
        """A sequence's first `num_tokens` tokens, token-major in the storage dtype — only what it needs, not
        whole pages: kv [L, T, C + R], index [L_idx, T, Di], and with FP8 their scales [L, T], [L_idx, T].
        `out` (tensors of `token_shapes`, e.g. views of a staging buffer) receives them without another copy."""
        out = out if out is not None else {name: torch.empty(shape, dtype=dtype, device=self.kv.device)
                                           for name, (dtype, shape) in self.token_shapes(num_tokens).items()}
        for name, data in self._parts().items():
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
        for name, data in self._parts().items():
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
    def _gather(self, data: torch.Tensor, scale: torch.Tensor | None, page_table: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, pages = page_table.shape
        values = data[page_table].view(batch, pages * self.page_size, -1).to(dtype)     # [B, S_max, D]
        if scale is None:
            return values, None
        return values, scale[page_table].view(batch, pages * self.page_size)            # [B, S_max]

    def gather(self, layer: int, page_table: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """page_table [B, pages] -> (kv [B, pages * page_size, C + R] in `dtype`, per-token scale or None)."""
        return self._gather(self.kv[layer], None if self.scale is None else self.scale[layer], page_table, dtype)

    def gather_index(self, layer: int, page_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized indexer keys [B, pages * page_size, Di]."""
        i = self.index_slot[layer]
        keys, scale = self._gather(self.index[i], None if self.index_scale is None else self.index_scale[i],
                                   page_table, dtype)
        return keys if scale is None else keys * scale[..., None].to(dtype)


class PageAllocator:
    """Hands out pages of the pool.

    Invariants (checked by `check`):
      * every page is either on the free list or in exactly one request's page table, never both;
      * a request's page table has exactly ceil(tokens / page_size) pages for the tokens it has cached;
      * the free list is FIFO: a freed page goes to the back, so it is reused as late as possible (a stale
        reference to it keeps pointing at the old data for as long as the pool allows);
      * a page is released at most once per allocation: releasing a page that is already free does nothing
        (counted in `double_frees`), so one bookkeeping bug cannot put a page on the free list twice.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free: deque[int] = deque(range(num_pages))
        self.is_free = [True] * num_pages
        self.double_frees = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages from the front of the free list, or None (and nothing taken) if there are too few."""
        if count > len(self.free):
            return None
        pages = [self.free.popleft() for _ in range(count)]
        for page in pages:
            self.is_free[page] = False
        return pages

    def release(self, pages: list[int]) -> None:
        for page in pages:
            if self.is_free[page]:
                self.double_frees += 1
                continue
            self.is_free[page] = True
            self.free.append(page)

    def check(self, page_tables: dict[int, list[int]], cached_tokens: dict[int, int], page_size: int) -> None:
        """Raise AssertionError if the invariants above do not hold for these requests' tables."""
        owned = [page for table in page_tables.values() for page in table]
        assert len(owned) == len(set(owned)), "a page is in two page tables"
        assert not set(owned) & set(self.free), "a page is both owned and free"
        assert len(owned) + len(self.free) == self.num_pages, "a page is neither owned nor free"
        assert len(self.free) == len(set(self.free)), "a page is on the free list twice"
        for request_id, table in page_tables.items():
            need = -(-cached_tokens[request_id] // page_size)
            assert len(table) == need, f"request {request_id} holds {len(table)} pages for {need} pages of tokens"
