"""The engine's settings (`EngineConfig`) and the values they take (and nano eval's token limit), without torch.

Importing torch takes seconds; the `nano` command line checks its flags against what is here before torch loads,
so that `nano -h` or a mistyped flag answers at once. Only the functions that ask the machine (its devices and
their free memory) import torch, when they are called.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nano.config import TILES
from nano.errors import NanoError, UsageError

if TYPE_CHECKING:
    import torch

    from nano.config import ModelConfig

WEIGHT_FORMATS = ("auto", "bf16", "fp8", "int4")
KV_DTYPES = ("fp32", "bf16", "fp8")
# how FP8 pages hold a token's latent ‖ rope key (nano/kv.py): a scale per token, one per layer (fixed), or FlashMLA's
# tiles (latent FP8 with a power-of-two scale per quarter, 128 values of the real 512, rope key BF16)
KV_LAYOUTS = ("token", "tensor", "tile")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}   # -> torch's name
DECODE_KERNELS = ("auto", "triton", "torch")
TRANSPORTS = ("shm", "gloo")   # how the split's workers move KV (nano/disagg)
# nano eval's most tokens per context (nano/evaluate.py): the bootstrap holds resamples x windows, the KL
# logits tokens x vocab
MAX_TOKENS = 2**17
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


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_device() -> torch.device:
    """Where an LLM runs unless told: the GPU when there is one."""
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> str:
    """The weights' and activations' dtype unless told: bfloat16 on a GPU, float32 on CPU."""
    return "bfloat16" if device.type == "cuda" else "float32"


def model_kv_dtype(dtype: str) -> str:
    """The KV dtype `auto` stands for: the model's own precision, exact against the reference."""
    return "bf16" if DTYPES.get(dtype) == "bfloat16" else "fp32"


def free_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device`: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        import torch
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):   # not Linux: the physical memory is the best bound known
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_kv_budget(device: torch.device) -> int:
    """Half of the GPU memory left free once the weights are loaded; 256 MiB on CPU (the pool is zero-filled,
    so its bytes are really touched: ~13k tokens of a nano stand-in in fp32, ~200 per conversation is typical)."""
    return free_memory(device) // 2 if device.type == "cuda" else 256 * 2**20


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of an engine, in one place: `LLM`, `SplitLLM` (each worker gets its copy), `Engine`, the
    tensor-parallel ranks and the CLI's flags (`--kv-dtype` is `kv_dtype`) all take this. `check()` validates it
    before anything loads; `replace(**changes)` is a changed copy."""
    weights: str = "auto"                # a format (auto: as the checkpoint stores them, bf16, fp8, int4), or a
                                         # checkpoint directory to load for a preset (in its stored formats)
    prefill_weights: str | None = None   # each phase's format (default: weights')
    decode_weights: str | None = None
    int4_all: bool = False               # with int4: pack every linear layer, not only the routed experts
    int4_group_size: int = 32            # INT4 inputs per scale
    dtype: str | None = None             # float32 | bfloat16 (default: default_dtype(device))
    device: str | None = None            # default: default_device()
    kv_dtype: str = "auto"               # auto (the model's dtype) | fp32 | bf16 | fp8
    kv_layout: str = "token"             # FP8 pages: token | tensor | tile (KV_LAYOUTS; other dtypes have one)
    kv_budget: str | int | None = None   # the KV pool's bytes, e.g. "256MiB" (default: default_kv_budget)
    page_size: int = 64                  # tokens per KV page
    max_running: int = 256               # most requests in a step
    max_step_tokens: int = 512           # most tokens in a step (prefill chunks + decodes)
    decode_kernel: str = "auto"          # auto (Triton on a GPU when the shapes fit) | triton | torch
    integrity: bool = True               # check each step's page tables against the pages given (nano/integrity.py)
    prefix_cache: bool = True            # share the KV pages of prompts seen before (nano/kv.py)
    threads: int | None = None           # torch's CPU threads (default: nano.llm.default_threads())
    tp: int = 1                          # tensor-parallel ranks (nano/parallel.py)
    seed: int = 0                        # the random stand-in's weights and every request's sampling stream

    def replace(self, **changes: Any) -> EngineConfig:
        unknown = set(changes) - {field.name for field in dataclasses.fields(self)}
        if unknown:
            raise NanoError(f"no engine setting {sorted(unknown)[0]!r}")
        return dataclasses.replace(self, **changes)

    @property
    def weights_dir(self) -> str | None:
        """The checkpoint directory `weights` names, if it names one rather than a format."""
        return None if self.weights in WEIGHT_FORMATS else self.weights

    @property
    def phase_weights(self) -> tuple[str, str]:
        """(prefill, decode) weight formats."""
        stored = "auto" if self.weights_dir else self.weights
        return self.prefill_weights or stored, self.decode_weights or stored

    @property
    def kv_budget_bytes(self) -> int:
        return default_kv_budget(self.torch_device) if self.kv_budget is None else parse_bytes(self.kv_budget)

    @property
    def torch_device(self) -> torch.device:
        import torch
        return torch.device(self.device) if self.device else default_device()

    @property
    def resolved_kv_dtype(self) -> str:
        return model_kv_dtype(self.dtype or default_dtype(self.torch_device)) if self.kv_dtype == "auto" \
            else self.kv_dtype

    def check(self, name: Callable[[str], str] = str, pools: int = 1) -> None:
        """Every value and combination, before anything loads: UsageError for a value wrong by itself, NanoError
        for one this machine cannot meet. `name` spells a setting in the message (the CLI: its flag); `pools`:
        how many KV pools of `kv_budget` this host allocates (the split's two workers: 2)."""
        def one_of(setting: str, allowed: tuple[str, ...]) -> None:
            if getattr(self, setting) not in allowed:
                raise UsageError(f"{name(setting)} must be one of {', '.join(allowed)}; got {getattr(self, setting)!r}")
        if self.weights_dir and not Path(self.weights_dir).expanduser().exists():
            raise NanoError(f"{name('weights')} {self.weights}: neither a weight format ({', '.join(WEIGHT_FORMATS)}) "
                            f"nor an existing checkpoint directory")
        for setting in ("prefill_weights", "decode_weights"):
            if getattr(self, setting) is not None:
                one_of(setting, WEIGHT_FORMATS)
        if self.dtype is not None:
            one_of("dtype", tuple(DTYPES))
        one_of("kv_dtype", ("auto", *KV_DTYPES))
        one_of("kv_layout", KV_LAYOUTS)
        if self.kv_layout != "token" and self.kv_dtype in ("fp32", "bf16"):
            raise UsageError(f"{name('kv_layout')} {self.kv_layout} lays out FP8 pages; {self.kv_dtype} pages have one "
                             f"layout (use {name('kv_dtype')} fp8)")
        one_of("decode_kernel", DECODE_KERNELS)
        for setting in ("page_size", "max_running", "max_step_tokens", "int4_group_size", "tp"):
            if getattr(self, setting) < 1:
                raise UsageError(f"{name(setting)} must be at least 1; got {getattr(self, setting)}")
        if not 0 <= self.seed < 2**64:
            raise UsageError(f"{name('seed')} must be between 0 and 2**64 - 1; got {self.seed}")
        if self.int4_all and "int4" not in (self.weights, *self.phase_weights):
            raise UsageError(f"{name('int4_all')} needs int4 weights: add {name('weights')} int4, "
                             f"{name('prefill_weights')} int4 or {name('decode_weights')} int4")
        if self.threads is not None and not 1 <= self.threads <= usable_cores():
            raise NanoError(f"{name('threads')} must be between 1 and the {usable_cores()} cores this process may "
                            f"use; got {self.threads}")
        if self.kv_budget is None:   # the default is sized to the machine (and finding it would load torch)
            return
        try:
            budget = parse_bytes(self.kv_budget)
        except NanoError as error:
            raise UsageError(f"{name('kv_budget')}: {error}") from None
        if pools * budget > free_memory(self.torch_device):
            raise NanoError(f"{name('kv_budget')} {self.kv_budget}{' (per worker)' if pools > 1 else ''} is more than "
                            f"the free memory ({free_memory(self.torch_device) / 2**30:.1f} GiB on "
                            f"{self.torch_device.type}); nothing was allocated")

    def check_fits(self, model: ModelConfig, name: Callable[[str], str] = str) -> None:
        """The KV budget holds at least one page of this model in the KV dtype (from the config: nothing loads)."""
        if self.resolved_kv_dtype == "fp8" and self.kv_layout == "tile" and model.kv_lora_rank % TILES:
            raise NanoError(f"{name('kv_layout')} tile scales the latent in {TILES} tiles, and this model's latent "
                            f"has {model.kv_lora_rank} values: use {name('kv_layout')} token or tensor")
        budget = self.kv_budget_bytes
        page_bytes = model.kv_bytes_per_token(self.resolved_kv_dtype, self.kv_layout) * self.page_size
        if page_bytes > budget:
            given = f"{name('kv_budget')} {self.kv_budget}" if self.kv_budget else \
                f"the default KV budget ({budget / 2**20:,.0f} MiB)"
            raise NanoError(f"{given} holds no page of {name('page_size')} {self.page_size} tokens ({page_bytes:,} B "
                            f"each in {self.resolved_kv_dtype}); raise the budget or lower the page size")
