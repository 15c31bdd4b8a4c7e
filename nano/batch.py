"""The one step context: what a model step reads besides its inputs.

The engine builds a `ForwardBatch` for every forward pass, after the integrity check, from the page tables it
checked; the model reads it (where each new token's KV goes, which rows attend together, which weights and kernels
this pass uses). Nothing else carries per-step switches: no module attribute is flipped.

The model works on a *flattened batch*: the new tokens of every sequence in the pass stacked as rows
[N, hidden] (prefill chunks and single decode tokens side by side).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nano.kv import KVPool


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of a step: its page table, the tokens already cached and the tokens it adds now."""
    page_table: list[int]
    num_cached: int
    num_new: int


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences whose new tokens attend together: one sequence's prefill chunk, or every sequence that adds a
    single token this step (the decode batch). All B sequences of a group add the same number n of tokens."""
    rows: torch.Tensor         # [B * n] rows of the flattened batch, sequence by sequence
    page_table: torch.Tensor   # [B, pages] int64, padded with page 0 past a sequence's last page
    seq_lens: torch.Tensor     # [B] tokens cached once this step's tokens are written
    num_new: int               # n
    allowed: torch.Tensor      # [B, n, pages * page_size] bool: causal, and inside the sequence
    max_len: int               # longest sequence of the group (host-side, so no device sync is needed)

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One forward pass: the pool to read and write, where each new token goes, the attention groups, and the
    switches the engine sets for this pass."""
    pool: KVPool
    slots: torch.Tensor           # [N] flat pool address (page * page_size + offset) of each new token
    groups: list[AttentionGroup]
    decode: bool = False          # run the decode weights (every sequence adds one token) instead of prefill's
    use_kernels: bool = False     # GPU paths: the Triton paged MLA decode kernel and the fused INT4 MoE kernel

    @classmethod
    def build(cls, pool: KVPool, seqs: list[SequenceStep], device: torch.device, *, decode: bool = False,
              use_kernels: bool = False) -> ForwardBatch:
        """Rows are laid out sequence by sequence, in the order of `seqs`."""
        page_size, slots, starts, row = pool.page_size, [], [], 0
        for seq in seqs:
            slots += pool.slots(seq.page_table, seq.num_cached, seq.num_new)
            starts.append(row)
            row += seq.num_new
        singles = [i for i, seq in enumerate(seqs) if seq.num_new == 1]
        chunks = [[i] for i, seq in enumerate(seqs) if seq.num_new > 1]
        groups = []
        for members in ([singles] if singles else []) + chunks:
            num_new = seqs[members[0]].num_new
            width = max(len(seqs[i].page_table) for i in members)
            table = torch.tensor([seqs[i].page_table + [0] * (width - len(seqs[i].page_table)) for i in members],
                                 device=device)
            lengths = [seqs[i].num_cached + num_new for i in members]
            seq_lens = torch.tensor(lengths, device=device)
            rows = torch.tensor([starts[i] + j for i in members for j in range(num_new)], device=device)
            query_pos = seq_lens[:, None] - num_new + torch.arange(num_new, device=device)       # [B, n]
            allowed = torch.arange(width * page_size, device=device) <= query_pos[..., None]    # [B, n, S]
            groups.append(AttentionGroup(rows, table, seq_lens, num_new, allowed, max(lengths)))
        slots = torch.tensor(slots, dtype=torch.long, device=device)
        return cls(pool, slots, groups, decode, use_kernels)
