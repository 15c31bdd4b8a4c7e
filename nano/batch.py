"""The one step context: what a model step reads besides its inputs.

The engine builds a `ForwardBatch` for every forward pass, after the integrity check and from the checked
(page, tag) records; the model reads it (where each new token's KV goes, which rows attend together, which weights
and kernels this pass uses). With integrity on it carries a `PageGuard`: the model verifies every write and every
page-table read against the records at the moment it touches the pool, so a table or a slot changed after the
check is refused, not used. Nothing else carries per-step switches: no module attribute is flipped.

The model works on a *flattened batch*: the new tokens of every sequence in the pass stacked as rows
[N, hidden] (prefill chunks and single decode tokens side by side).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nano.kv import KVPool


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of a step: its page table, the tokens already cached, the tokens it adds now, and
    (integrity on) the tag each page had when the sequence was given it."""
    page_table: list[int]
    num_cached: int
    num_new: int
    page_tags: list[int] | None = None


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences whose new tokens attend together: one sequence's prefill chunk, or every sequence that adds a
    single token this step (the decode batch). All B sequences of a group add the same number n of tokens."""
    members: list[int]         # which sequences of the step (indices into ForwardBatch.build's seqs)
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
class PageGuard:
    """The checked records of a pass, kept apart from the tensors the model uses, and the live page tags. A write
    whose target page or tag is not its writer's goes to the pool's scratch page instead; a table entry whose page
    or tag is not its reader's reads the scratch page. Either counts against the sequence in `violations`."""
    live_tags: torch.Tensor                  # [P] the tracker's tags now
    row_pages: torch.Tensor                  # [N] the page each new token must land in, from the records
    row_tags: torch.Tensor                   # [N] that page's tag when its sequence was given it
    row_owner: torch.Tensor                  # [N] the sequence (index into seqs) of each row
    tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]   # per group: pages, tags [B, W], valid [B, W]
    violations: torch.Tensor                 # [len(seqs)] int32: refused writes and reads per sequence


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One forward pass: the pool to read and write, where each new token goes, the attention groups, and the
    switches the engine sets for this pass."""
    pool: KVPool
    slots: torch.Tensor           # [N] flat pool address (page * page_size + offset) of each new token
    groups: list[AttentionGroup]
    decode: bool = False          # run the decode weights (every sequence adds one token) instead of prefill's
    use_kernels: bool = False     # GPU paths: the Triton paged MLA decode kernel and the fused INT4 MoE kernel
    guard: PageGuard | None = None   # integrity on: the records every write and read is verified against

    def write_slots(self) -> torch.Tensor:
        """[N] where the new tokens' KV goes: `slots`, with every row whose page or tag is not its writer's sent to
        the scratch page instead (and counted)."""
        guard, size = self.guard, self.pool.page_size
        if guard is None:
            return self.slots
        pages = self.slots // size
        ok = (pages == guard.row_pages) & (guard.live_tags[pages] == guard.row_tags)               # [N]
        guard.violations.index_add_(0, guard.row_owner, (~ok).int())
        return torch.where(ok, self.slots, self.pool.scratch_page * size + self.slots % size)

    def read_table(self, g: int) -> torch.Tensor:
        """Group g's page table [B, W] as attention reads it: entries whose page or tag is not the reader's read the
        scratch page instead (and are counted)."""
        group, guard = self.groups[g], self.guard
        if guard is None:
            return group.page_table
        pages, tags, valid = guard.tables[g]
        wrong = ((group.page_table != pages) | (guard.live_tags[group.page_table] != tags)) & valid    # [B, W]
        guard.violations.index_add_(0, torch.tensor(group.members, device=pages.device), wrong.sum(1).int())
        return torch.where(wrong, self.pool.scratch_page, group.page_table)

    @classmethod
    def build(cls, pool: KVPool, seqs: list[SequenceStep], device: torch.device, *, decode: bool = False,
              use_kernels: bool = False, live_tags: torch.Tensor | None = None) -> ForwardBatch:
        """Rows are laid out sequence by sequence, in the order of `seqs`. With `live_tags` (integrity on; every
        seq then has its page_tags) the batch carries a PageGuard built from the same records."""
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
            groups.append(AttentionGroup(members, rows, table, seq_lens, num_new, allowed, max(lengths)))
        slots = torch.tensor(slots, dtype=torch.long, device=device)
        guard = None if live_tags is None else _guard(pool.page_size, seqs, groups, live_tags, device)
        return cls(pool, slots, groups, decode, use_kernels, guard)


def _guard(page_size: int, seqs: list[SequenceStep], groups: list[AttentionGroup], live_tags: torch.Tensor,
           device: torch.device) -> PageGuard:
    """The records as separate tensors: each new row's page and tag by its position, each group's table and tags."""
    row_pages, row_tags, row_owner = [], [], []
    for i, seq in enumerate(seqs):
        for position in range(seq.num_cached, seq.num_cached + seq.num_new):
            row_pages.append(seq.page_table[position // page_size])
            row_tags.append(seq.page_tags[position // page_size])
            row_owner.append(i)
    tables = []
    for group in groups:
        width = group.page_table.shape[1]
        pad = lambda rows: torch.tensor([row + [0] * (width - len(row)) for row in rows], device=device)
        lengths = torch.tensor([len(seqs[i].page_table) for i in group.members], device=device)
        members = [seqs[i] for i in group.members]
        tables.append((pad([seq.page_table for seq in members]), pad([seq.page_tags for seq in members]),
                       torch.arange(width, device=device) < lengths[:, None]))
    tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)
    return PageGuard(live_tags, tensor(row_pages), tensor(row_tags), tensor(row_owner), tables,
                     torch.zeros(len(seqs), dtype=torch.int32, device=device))
