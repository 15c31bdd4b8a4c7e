"""Tensor and expert parallelism over torch.distributed: one model split across ranks (GPUs, or CPU processes).

What each rank holds (Megatron-style tensor parallelism for attention and dense MLPs, expert parallelism for MoE):

  attention   heads split: q_b_proj (or q_proj) and kv_b_proj keep this rank's heads' rows, so each rank absorbs
              its own heads' W_UK / W_UV; o_proj keeps the matching input columns (row-parallel) and the layer's
              output is summed over ranks (one all-reduce). q_a_proj, kv_a_proj and the DSA indexer are
              replicated: the latent c and rope key are shared by all heads, so every rank computes and caches the
              whole 576-value latent. A rank's KV pool therefore holds as many tokens as one device alone would.
  MoE         routed experts divided among ranks (contiguous ranges), the router replicated: each rank runs its
              own experts for the tokens routed to them; the shared experts are split like a dense MLP; one
              all-reduce sums the layer.
  dense MLP   gate/up keep this rank's slice of the intermediate rows, down the matching columns; one all-reduce.
  vocabulary  embed_tokens and lm_head keep a slice of the vocabulary: the embedding is summed over ranks (a rank
              contributes only the ids it holds), the logits are gathered.

The all-reduces and the gather are forward hooks on the modules, so the parameter names stay the checkpoint's and
a single-device model carries none of this. `shard` slices a model (its meta tensors before loading, or real ones)
and returns the `Sharding` the loader reads each rank's slices with (safetensors get_slice: no rank reads the whole
checkpoint).

One scheduler: rank 0 owns the engine, the page allocator and the integrity check. Before every forward pass it
sends the pass (token ids, positions, each sequence's page table and counts) to the other ranks, as int64 tensors
(no pickle), and every rank runs the same pass on its own KV pool, whose pages are laid out alike. Sampling happens
on rank 0. The ranks meet once each has loaded its part, before the first pass (up to MEETING); from then on a rank
that dies or hangs makes the next collective fail within `step_timeout_s()` (30 s unless NANO_TP_TIMEOUT says
otherwise), which rank 0 reports as one error.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from nano.batch import ForwardBatch, SequenceStep
from nano.config import ModelConfig
from nano.errors import NanoError, brief
from nano.kv import KVPool
from nano.loader import Sharding, TensorSlice
from nano.model import MLP, MLAttention, MoE, Transformer

COMMUNICATION = "tp communication"  # the profiler range of every collective inside a pass: "tp communication (part)"
WORKER_ARGS_ENV = "NANO_TP_LLM"      # the LLM keyword arguments a spawned rank builds its model from (JSON)
MEETING = timedelta(minutes=5)       # how long the ranks that rank 0 starts may take to meet it
_STOP, _FORWARD = 0, 1


def step_timeout_s() -> float:
    """How long a collective inside a step may wait for the slowest rank before the run ends with an error."""
    return float(os.environ.get("NANO_TP_TIMEOUT", "30"))


# ---- the group ----------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class Group:
    """This process's place among the ranks. `step` carries every collective of a forward pass (bounded wait);
    `control` carries rank 0's next message to the others, which may wait as long as rank 0's user does."""
    rank: int
    world: int
    step: dist.ProcessGroup
    control: dist.ProcessGroup
    device: torch.device                                   # where collective buffers live (cuda for NCCL)
    workers: list[subprocess.Popen] = field(default_factory=list)   # ranks this process spawned (--tp N)
    broken: bool = False       # a collective failed: the other ranks cannot be told anything any more
    stopped: bool = False

    def stop(self) -> None:
        """Rank 0: tell the other ranks to exit (or, after a failure, end the ones it spawned), wait for its own,
        and leave the process group, so that another tensor-parallel LLM can start in this process."""
        if self.stopped or self.rank != 0:
            return
        self.stopped = True
        if self in _active:
            _active.remove(self)
        if not self.broken:
            try:
                dist.broadcast(torch.tensor([_STOP, 0, 0, 0, 0, 0], device=self.device), 0, group=self.control)
            except (RuntimeError, dist.DistError):   # a rank already gone: nothing to tell
                self.broken = True
        for worker in self.workers:
            try:
                worker.wait(timeout=1 if self.broken else step_timeout_s())
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        dist.destroy_process_group()
        if self.workers:   # the rendezvous this process set up for its own ranks
            for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
                os.environ.pop(name, None)

    def health(self) -> str | None:
        """Rank 0: None while every rank it started runs and no collective has failed; else why not, in one line."""
        for rank, worker in enumerate(self.workers, 1):
            if worker.poll() is not None:
                return f"tensor-parallel rank {rank} exited (exit code {worker.returncode})"
        return "a tensor-parallel rank stopped answering; the run has ended" if self.broken else None


_active: list[Group] = []   # the group this process leads (rank 0 of a tensor-parallel LLM), until it stops


def stop_ranks() -> None:
    """Stop the tensor-parallel group this process leads, if any (the CLI does at the end of every command)."""
    while _active:
        _active.pop().stop()


def launched_ranks() -> int:
    """The world size torchrun (or a spawning rank 0) gave this process, 1 when it runs alone."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextmanager
def stopped_on_error(group: Group | None) -> Iterator[None]:
    """Inside the block, an exception stops `group` (rank 0 ends the ranks it leads) before it propagates."""
    try:
        yield
    except BaseException:
        if group is not None:
            group.stop()
        raise


def check_split(cfg: ModelConfig, world: int) -> None:
    """Refuse, before any rank starts, a split the model's shapes do not allow."""
    if cfg.num_attention_heads % world:
        raise NanoError(f"--tp {world} does not divide the model's {cfg.num_attention_heads} attention heads")
    if cfg.attention_bias and world > 1:
        raise NanoError("tensor parallelism does not split attention biases yet (this model has attention_bias)")


def join(tp: int, spawn_args: dict | None = None, cfg: ModelConfig | None = None) -> Group | None:
    """Join (or, with `tp` > 1 and no launcher, create) the group of ranks; None for a single device.

    Under torchrun the environment names the rank and the rendezvous (env://). Otherwise rank 0 is this process: it
    hosts the rendezvous store on 127.0.0.1 only and starts ranks 1..tp-1 as `python -m nano.tp_worker`, each
    building the same LLM from `spawn_args` and meeting at that store."""
    launched = launched_ranks()
    if dist.is_initialized():
        raise NanoError("one tensor-parallel LLM per process at a time: close() the other first")
    if launched > 1 and tp not in (1, launched):
        raise NanoError(f"--tp {tp} does not match the {launched} ranks the launcher started")
    world = launched if launched > 1 else tp
    if world < 1:
        raise NanoError(f"--tp must be >= 1, got {tp}")
    if world == 1:
        return None
    if cfg is not None:
        check_split(cfg, world)
    workers: list[subprocess.Popen] = []
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    try:
        store = None   # under a launcher: its rendezvous (env://)
        if launched == 1:   # spawn the other ranks ourselves
            store = bound_store("127.0.0.1", 0, MEETING)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE=str(world))
            args = json.dumps(spawn_args)
            for rank in range(1, world):
                env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), WORKER_ARGS_ENV: args}
                workers.append(subprocess.Popen([sys.executable, "-m", "nano.tp_worker"], env=env))
        elif WORKER_ARGS_ENV in os.environ:   # a rank that rank 0 started: its store
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=MEETING)
        rank = int(os.environ["RANK"])
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()) if cuda \
            else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(days=7))
        step = dist.new_group(list(range(world)), timeout=timedelta(seconds=step_timeout_s()))
    except Exception as error:   # a rank that never came, a port taken: one line
        for worker in workers:
            worker.kill()
        raise NanoError(f"tensor parallelism: the {world} ranks could not meet ({brief(error)})") from None
    group = Group(rank, world, step, dist.group.WORLD, device, workers)
    if rank == 0:
        _active.append(group)
        atexit.register(stop_ranks)
    return group


def bound_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore server listening on `host` only (port 0: a free one, then `store.port`). Left to itself a TCPStore
    listens on every interface, and it has no authentication: the socket is bound here and handed over (the store
    owns and closes it). Raises OSError, RuntimeError or ValueError when it cannot listen there."""
    listening = socket.create_server((host, port), backlog=64)
    return dist.TCPStore(host, listening.getsockname()[1], is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listening.detach())


def _split(total: int, world: int, rank: int) -> tuple[int, int]:
    """This rank's contiguous share [start, stop) of `total` items, the first `total % world` ranks one longer."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


# ---- slicing the model --------------------------------------------------------------------------------------------

def shard(model: Transformer, group: Group) -> Sharding:
    """Cut `model` down to this rank's part, in place (meta tensors before loading, or real ones), install the
    collectives, and return what was kept. Every split must be even where the math needs it (heads)."""
    cfg, rank, world = model.cfg, group.rank, group.world
    check_split(cfg, world)
    slices: dict[str, TensorSlice] = {}
    dropped: list[str] = []

    def cut(module: nn.Module, name: str, dim: int, span: tuple[int, int]) -> None:
        weight = module.weight
        piece = weight.narrow(dim, span[0], span[1] - span[0])
        module.weight = nn.Parameter(piece if weight.is_meta else piece.clone(), requires_grad=False)
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
        slices[f"{name}.weight"] = TensorSlice(dim, *span)

    for name, module in list(model.named_modules()):
        if isinstance(module, MLAttention):
            heads = _split(cfg.num_attention_heads, world, rank)
            per_head = lambda width: (heads[0] * width, heads[1] * width)
            q_name = "q_b_proj" if cfg.q_lora_rank else "q_proj"
            cut(getattr(module, q_name), f"{name}.{q_name}", 0, per_head(cfg.qk_head_dim))
            cut(module.kv_b_proj, f"{name}.kv_b_proj", 0, per_head(cfg.qk_nope_head_dim + cfg.v_head_dim))
            cut(module.o_proj, f"{name}.o_proj", 1, per_head(cfg.v_head_dim))
            module.num_heads = heads[1] - heads[0]
            module.register_forward_hook(_all_reduce_hook(group, "attention"))
        elif isinstance(module, MoE):
            first, last = _split(len(module.experts), world, rank)
            for index in [*range(first), *range(last, len(module.experts))]:
                module.experts[index] = None
                dropped.append(f"{name}.experts.{index}.")
            module.expert_offset = first
            if module.shared_experts is not None:
                _split_mlp(module.shared_experts, f"{name}.shared_experts", cut, world, rank)
            module.register_forward_hook(_all_reduce_hook(group, "moe"))
        elif isinstance(module, MLP) and ".mlp" in name and ".experts." not in name and "shared" not in name:
            _split_mlp(module, name, cut, world, rank)
            module.register_forward_hook(_all_reduce_hook(group, "dense MLP"))
    vocab = _split(cfg.vocab_size, world, rank)
    embedding = VocabSliceEmbedding(model.model.embed_tokens, vocab, group)
    model.model.embed_tokens = embedding
    cut(embedding, "model.embed_tokens", 0, vocab)
    if cfg.tie_word_embeddings:
        model.tie_embeddings()
        slices["lm_head.weight"] = slices["model.embed_tokens.weight"]
    else:
        cut(model.lm_head, "lm_head", 0, vocab)
    model.lm_head.register_forward_hook(_gather_vocab(group, cfg.vocab_size))
    return Sharding(rank, world, slices, tuple(dropped))


def _split_mlp(mlp: MLP, name: str, cut, world: int, rank: int) -> None:
    span = _split(mlp.gate_proj.out_features, world, rank)
    cut(mlp.gate_proj, f"{name}.gate_proj", 0, span)
    cut(mlp.up_proj, f"{name}.up_proj", 0, span)
    cut(mlp.down_proj, f"{name}.down_proj", 1, span)


def _all_reduce_hook(group: Group, part: str):
    """A forward hook that sums the module's output over the ranks (each holds a partial sum). The profiler sees
    it as "all-reduce (part)" (`nano profile --tp N` reports communication from these ranges)."""
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        with record_function(f"{COMMUNICATION} ({part})"):
            dist.all_reduce(output, group=group.step)
        return output
    return hook


class VocabSliceEmbedding(nn.Module):
    """The embedding rows of this rank's vocabulary slice [first, stop): an id outside it contributes zeros, and the
    all-reduce sums the one rank's real row per id. Its parameter keeps the name `weight`."""

    def __init__(self, full: nn.Embedding, vocab: tuple[int, int], group: Group) -> None:
        super().__init__()
        self.weight, (self.first, self.stop), self.group = full.weight, vocab, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.first) & (ids < self.stop)                                  # [N]
        rows = F.embedding((ids - self.first).clamp(0, self.stop - self.first - 1), self.weight)   # [N, hidden]
        rows = rows * mine[:, None].to(rows.dtype)
        with record_function(f"{COMMUNICATION} (embedding)"):
            dist.all_reduce(rows, group=self.group.step)
        return rows


def _gather_vocab(group: Group, vocab_size: int):
    """A forward hook for the lm_head: every rank's logits slice [N, V/ranks], gathered into [N, V] on all ranks."""
    width = -(-vocab_size // group.world)

    def hook(module: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
        padded = F.pad(output, (0, width - output.shape[-1]))                          # [N, ceil(V/ranks)]
        pieces = [torch.empty_like(padded) for _ in range(group.world)]
        with record_function(f"{COMMUNICATION} (lm_head)"):
            dist.all_gather(pieces, padded.contiguous(), group=group.step)
        spans = [_split(vocab_size, group.world, r) for r in range(group.world)]
        return torch.cat([piece[..., :stop - start] for piece, (start, stop) in zip(pieces, spans)], -1)
    return hook


# ---- the pass, sent from rank 0 to the others ---------------------------------------------------------------------

class Peers:
    """Rank 0's end: sends each forward pass to the other ranks before running it itself."""

    def __init__(self, group: Group) -> None:
        """Made once rank 0 has loaded its part: waits (up to MEETING) until every rank has loaded its own and
        entered `serve`, so that the step timeout bounds passes, not a slower rank's loading."""
        self.group = group
        try:   # the other ranks' side of this barrier is at the start of `serve`
            dist.barrier(group=group.control, async_op=True).wait(timeout=MEETING)
        except (RuntimeError, dist.DistError) as error:
            raise NanoError(f"tensor parallelism: a rank did not finish loading ({brief(error)})") from None

    def run_pass(self, model: Transformer, seqs: list[SequenceStep], batch: ForwardBatch, ids: torch.Tensor,
                 positions: torch.Tensor, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """Send the pass, then run it here; a rank that is gone or stuck ends it with one NanoError."""
        try:
            self._send(seqs, batch.decode, ids, positions, logits_rows)
            return model(ids, positions, batch, logits_rows)
        except (RuntimeError, dist.DistError) as error:
            self.group.broken = True
            raise NanoError(f"tensor parallelism: a rank stopped answering ({brief(error)}); the run ends") from None

    def _send(self, seqs: list[SequenceStep], decode: bool, ids: torch.Tensor, positions: torch.Tensor,
              logits_rows: torch.Tensor | None) -> None:
        payload = [ids.tolist(), positions.tolist(), [] if logits_rows is None else logits_rows.tolist()]
        flat = [*payload[0], *payload[1], *payload[2]]
        for seq in seqs:
            flat += [seq.num_cached, seq.num_new, len(seq.page_table), *seq.page_table]
        header = torch.tensor([_FORWARD, int(decode), len(seqs), len(payload[0]),
                               -1 if logits_rows is None else len(payload[2]), len(flat)], device=self.group.device)
        # the other ranks may wait for this header as long as rank 0's user does, but rank 0 waits a bounded time
        dist.broadcast(header, 0, group=self.group.control, async_op=True).wait(
            timeout=timedelta(seconds=step_timeout_s()))
        dist.broadcast(torch.tensor(flat, dtype=torch.long, device=self.group.device), 0, group=self.group.step)


def serve(model: Transformer, pool: KVPool, group: Group, use_kernels: bool) -> None:
    """Ranks 1..N-1: run every pass rank 0 sends, on this rank's part of the model and its own pool, until rank 0
    says stop (or goes away)."""
    device = pool.kv.device
    dist.barrier(group=group.control)   # loaded: rank 0 (in `Peers`) may start sending passes
    with torch.inference_mode():
        while True:
            header = torch.zeros(6, dtype=torch.long, device=group.device)
            dist.broadcast(header, 0, group=group.control)
            op, decode, num_seqs, num_ids, num_rows, length = header.tolist()
            if op == _STOP:
                return
            flat = torch.empty(length, dtype=torch.long, device=group.device)
            dist.broadcast(flat, 0, group=group.step)
            values = flat.tolist()
            ids, positions = values[:num_ids], values[num_ids:2 * num_ids]
            at = 2 * num_ids + max(num_rows, 0)
            rows = values[2 * num_ids:at] if num_rows >= 0 else None
            seqs = []
            for _ in range(num_seqs):
                num_cached, num_new, pages = values[at:at + 3]
                seqs.append(SequenceStep(values[at + 3:at + 3 + pages], num_cached, num_new))
                at += 3 + pages
            batch = ForwardBatch.build(pool, seqs, device, decode=bool(decode), use_kernels=use_kernels)
            model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), batch,
                  None if rows is None else torch.tensor(rows, device=device))
