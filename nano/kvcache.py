"""A plain per-request MLA cache: one contiguous buffer per sequence, sized for its prompt + generation.

Holds, for every layer and token, the normalised latent [C] and the rotated rope key [R] — never expanded
per-head keys or values — and, on GLM-5's "full" indexer layers, the indexer key. (The paged pool of the
engine replaces this buffer with fixed-size pages shared by all requests.)
"""
from __future__ import annotations

import torch

from nano.config import ModelConfig


class ContiguousKV:
    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str) -> None:
        layers = cfg.num_hidden_layers
        self.capacity = capacity
        self.latent = torch.empty(layers, capacity, cfg.kv_lora_rank, dtype=dtype, device=device)
        self.rope_key = torch.empty(layers, capacity, cfg.qk_rope_head_dim, dtype=dtype, device=device)
        # indexer keys only for the layers that run the indexer; slot[layer] maps a layer to its row
        self.index_slot = {layer: i for i, layer in enumerate(cfg.indexer_layers)}
        self.index_key = torch.empty(len(self.index_slot), capacity, cfg.index_head_dim, dtype=dtype, device=device)

    def write(self, layer: int, start: int, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        end = start + latent.shape[0]
        self.latent[layer, start:end] = latent
        self.rope_key[layer, start:end] = rope_key

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.latent[layer, :length], self.rope_key[layer, :length]

    def write_index(self, layer: int, start: int, index_key: torch.Tensor) -> None:
        self.index_key[self.index_slot[layer], start:start + index_key.shape[0]] = index_key

    def read_index(self, layer: int, length: int) -> torch.Tensor:
        return self.index_key[self.index_slot[layer], :length]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.latent, self.rope_key, self.index_key))
