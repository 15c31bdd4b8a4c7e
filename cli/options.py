"""The engine flags that `nano chat`, `nano bench` and `nano profile` share, and how they become an LLM (or a
SplitLLM).

Each flag is declared once here as an `Annotated` type, so every command shows the same help. `EngineOptions`
holds their values, checks them before anything loads (one clear error naming the flag), and builds the engine.
A command gets the flags with the `@engine_flags()` decorator: it declares its own parameters plus
`engine: EngineOptions`, and receives the flags' values gathered into that one object:

    @engine_flags(skip=("kv_budget",))
    def profile(model: Model, batch: int = 8, *, engine: EngineOptions) -> None:
        llm = engine.build(model)

A flag is refused (exit 2) when it would do nothing in the combination given, rather than silently ignored: the
decorator records which flags the user typed (`EngineOptions.typed`), and `check()` compares them with the mode.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from nano.disagg import TRANSPORTS, SplitLLM
from nano.errors import NanoError
from nano.kv import KV_DTYPES, default_kv_budget, free_memory, parse_bytes
from nano.llm import LLM, default_device, default_dtype, model_kv_dtype, resolve_config, usable_cores
from nano.parallel import launched_ranks
from nano.quant import WEIGHT_FORMATS

from .console import UsageError


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


ENGINE, SPLIT = "Engine", "Prefill/decode split"   # the help panels the flags are listed under
SEED_RANGE: dict[str, Any] = {"min": 0, "max": 2**32 - 1}   # every --seed (torch's generators take 64 bits)

MODEL_HELP = ("MODEL is a preset (see `nano models`; `<preset>-random` for its random-weight stand-in), a checkpoint "
              "directory, or a Hugging Face hub id.")
# described by MODEL_HELP in each command's help text, so the help has no separate "Arguments" section
Model = Annotated[str, typer.Argument(metavar="MODEL", show_default=False, hidden=True)]
Weights = Annotated[str, typer.Option(
    "--weights", metavar="FORMAT|DIR", rich_help_panel=ENGINE,
    help="Weight format: auto (as the checkpoint stores them), bf16 (unquantized), fp8, int4 (routed experts "
         "packed 4-bit); or a checkpoint directory to load for a preset.")]
PrefillWeights = Annotated[str | None, typer.Option(
    metavar="FORMAT", rich_help_panel=ENGINE, help="Weight format for prefill steps (default: --weights).")]
DecodeWeights = Annotated[str | None, typer.Option(
    metavar="FORMAT", rich_help_panel=ENGINE, help="Weight format for decode steps (default: --weights).")]
Int4All = Annotated[bool, typer.Option(
    "--int4-all", rich_help_panel=ENGINE,
    help="With int4 weights: pack every linear layer, not only the routed experts.")]
Dtype = Annotated[DType | None, typer.Option(
    metavar="float32|bfloat16", rich_help_panel=ENGINE,
    help="Weight and activation dtype (default: bfloat16 on GPU, float32 on CPU). On a CPU without bf16 matmuls "
         "(no AVX512-BF16 or AMX), bfloat16 keeps bf16 weight values and KV pages but multiplies in float32.")]
KvDtype = Annotated[str, typer.Option(
    metavar="auto|fp32|bf16|fp8", rich_help_panel=ENGINE,
    help="KV-cache dtype. auto: the model's dtype; fp8: e4m3 with a scale per token, about half the bytes.")]
KvBudget = Annotated[str | None, typer.Option(
    metavar="SIZE", rich_help_panel=ENGINE,
    help="Memory for the KV-cache pool, e.g. 256MiB or 2GiB (default: 256MiB on CPU, half the free GPU memory).")]
PageSize = Annotated[int, typer.Option(
    metavar="N", min=1, rich_help_panel=ENGINE, help="Tokens per KV-cache page.")]
MaxRunning = Annotated[int, typer.Option(
    metavar="N", min=1, rich_help_panel=ENGINE, help="Most requests the engine runs at once.")]
Threads = Annotated[int | None, typer.Option(
    metavar="N", min=1, rich_help_panel=ENGINE,
    help="CPU threads for torch. Default: OMP_NUM_THREADS if set, else one per core that other processes leave "
         "free (by the load average), at least one (one when torch was imported before nano: its threads would "
         "spin). A waiting thread spins briefly, then sleeps (GOMP_SPINCOUNT).")]
Tp = Annotated[int, typer.Option(
    "--tp", metavar="N", min=1, rich_help_panel=ENGINE,
    help="Split the model over N ranks (tensor parallel attention and MLPs, expert parallel MoE; gloo processes on "
         "CPU, one GPU each with NCCL). On one host nano starts the ranks itself; under torchrun it takes the "
         "launcher's ranks. See docs/parallel.md.")]
Integrity = Annotated[bool, typer.Option(
    "--integrity/--no-integrity", rich_help_panel=ENGINE,
    help="Check each step that every request reads exactly the KV pages (and page tags) it was given; off: a "
         "no-op tracker.")]
PrefixCache = Annotated[bool, typer.Option(
    "--prefix-cache/--no-prefix-cache", rich_help_panel=ENGINE,
    help="Keep the KV pages of prompts seen before and share them with requests that start with the same tokens "
         "(whole pages; LRU eviction when the pool needs space). See docs/prefix-cache.md.")]
Disagg = Annotated[bool, typer.Option(
    "--disagg", rich_help_panel=SPLIT,
    help="Prefill and decode in two worker processes, each with its own formats (defaults: prefill bf16 weights "
         "+ bf16 KV, decode int4 weights + fp8 KV; --prefill-weights and --decode-weights choose others). "
         "--threads applies to each worker.")]
PrefillKvDtype = Annotated[str, typer.Option(
    metavar="fp32|bf16|fp8", rich_help_panel=SPLIT, help="With --disagg: the prefill worker's KV dtype.")]
DecodeKvDtype = Annotated[str, typer.Option(
    metavar="fp32|bf16|fp8", rich_help_panel=SPLIT, help="With --disagg: the decode worker's KV dtype.")]
Transport = Annotated[str, typer.Option(
    metavar="shm|gloo", rich_help_panel=SPLIT,
    help="With --disagg: how the KV moves between the workers: shm (shared memory, one host) or gloo "
         "(torch.distributed over TCP; MASTER_ADDR/MASTER_PORT).")]

@dataclass
class EngineOptions:
    weights: str = "auto"
    prefill_weights: str | None = None
    decode_weights: str | None = None
    int4_all: bool = False
    dtype: str | None = None
    kv_dtype: str = "auto"
    kv_budget: str | None = None
    page_size: int = 64
    max_running: int = 256
    integrity: bool = True
    prefix_cache: bool = True
    disagg: bool = False
    prefill_kv_dtype: str = "bf16"
    decode_kv_dtype: str = "fp8"
    transport: str = "shm"
    threads: int | None = None
    tp: int = 1
    seed: int = 0
    typed: frozenset[str] = frozenset()   # the fields whose flags the user typed (the rest are defaults)

    @property
    def weights_dir(self) -> str | None:
        """--weights names a format, or (as before formats existed) a checkpoint directory for a preset."""
        return None if self.weights in WEIGHT_FORMATS else self.weights

    @property
    def split_weights(self) -> tuple[str, str]:
        """(prefill, decode) weight formats of a split: the per-phase flags, else --weights, else the production
        formats (BF16 prefill, INT4 decode)."""
        chosen = None if self.weights == "auto" or self.weights_dir else self.weights
        return self.prefill_weights or chosen or "bf16", self.decode_weights or chosen or "int4"

    def check(self) -> None:
        """Every flag's value and combination, before the model loads; the error names the flag. A flag that
        would do nothing here is a UsageError (exit 2)."""
        if self.weights_dir and not Path(self.weights_dir).expanduser().exists():
            raise NanoError(f"--weights {self.weights}: neither a weight format ({', '.join(WEIGHT_FORMATS)}) "
                            f"nor an existing checkpoint directory")
        for flag, value in (("--prefill-weights", self.prefill_weights), ("--decode-weights", self.decode_weights)):
            if value is not None and value not in WEIGHT_FORMATS:
                raise UsageError(f"{flag} must be one of {', '.join(WEIGHT_FORMATS)}; got {value!r}")
        if self.kv_dtype not in ("auto", *KV_DTYPES):
            raise UsageError(f"--kv-dtype must be one of auto, {', '.join(KV_DTYPES)}; got {self.kv_dtype!r}")
        for flag, value in (("--prefill-kv-dtype", self.prefill_kv_dtype),
                            ("--decode-kv-dtype", self.decode_kv_dtype)):
            if value not in KV_DTYPES:
                raise UsageError(f"{flag} must be one of {', '.join(KV_DTYPES)}; got {value!r}")
        if self.transport not in TRANSPORTS:
            raise UsageError(f"--transport must be one of {', '.join(TRANSPORTS)}; got {self.transport!r}")
        self.check_combination()
        if self.threads is not None and self.threads > usable_cores():
            raise NanoError(f"--threads {self.threads} is more than the {usable_cores()} cores this process may use")
        if self.kv_budget is not None:
            try:
                budget = parse_bytes(self.kv_budget)
            except NanoError as error:
                raise UsageError(f"--kv-budget: {error}") from None
            pools = 2 if self.disagg else 1   # the split's two workers each allocate a pool of this size
            device = default_device()
            if pools * budget > free_memory(device):
                raise NanoError(f"--kv-budget {self.kv_budget}{' (per worker)' if pools > 1 else ''} is more than the "
                                f"free memory ({free_memory(device) / 2**30:.1f} GiB on {device.type}); nothing was "
                                f"allocated")

    def check_model(self, model: str) -> None:
        """What the flags ask of this model, from its config alone (nothing loads): the KV budget must hold a page
        in every pool's dtype."""
        config = resolve_config(model, self.weights_dir)[1]
        device = default_device()
        budget = default_kv_budget(device) if self.kv_budget is None else parse_bytes(self.kv_budget)
        model_kv = model_kv_dtype(self.dtype or default_dtype(device))
        kv_dtypes = (self.prefill_kv_dtype, self.decode_kv_dtype) if self.disagg else \
            (model_kv if self.kv_dtype == "auto" else self.kv_dtype,)
        for kv_dtype in kv_dtypes:
            page_bytes = config.kv_bytes_per_token(kv_dtype) * self.page_size
            if page_bytes > budget:
                given = f"--kv-budget {self.kv_budget}" if self.kv_budget else f"the default KV budget " \
                                                                                f"({budget / 2**20:,.0f} MiB)"
                raise NanoError(f"{given} holds no page of --page-size {self.page_size} tokens ({page_bytes:,} B "
                                f"each in {kv_dtype}); raise the budget or lower the page size")

    def check_combination(self) -> None:
        """Refuse a typed flag that the other flags make pointless, one at a time."""
        typed = self.typed
        if self.disagg and "kv_dtype" in typed:
            raise UsageError("--kv-dtype does nothing with --disagg: the workers take --prefill-kv-dtype and "
                             "--decode-kv-dtype")
        if self.disagg and (self.tp > 1 or launched_ranks() > 1):
            raise UsageError("--disagg and tensor parallelism (--tp, torchrun) do not combine yet")
        for name in ("prefill_kv_dtype", "decode_kv_dtype", "transport"):
            if not self.disagg and name in typed:
                raise UsageError(f"--{name.replace('_', '-')} needs --disagg (it configures the split's workers)")
        formats = (*self.split_weights,) if self.disagg else (self.weights, self.prefill_weights, self.decode_weights)
        if self.int4_all and "int4" not in formats:
            raise UsageError("--int4-all needs int4 weights: add --weights int4, --prefill-weights int4 or "
                             "--decode-weights int4")

    def build(self, model: str, progress: bool = False) -> LLM | SplitLLM:
        self.check()
        self.check_model(model)
        budget = None if self.kv_budget is None else parse_bytes(self.kv_budget)
        common = dict(weights_dir=self.weights_dir, int4_all=self.int4_all, dtype=self.dtype, kv_budget=budget,
                      page_size=self.page_size, max_running=self.max_running, integrity=self.integrity,
                      prefix_cache=self.prefix_cache, seed=self.seed)
        if self.disagg:
            prefill_weights, decode_weights = self.split_weights
            return SplitLLM(model, prefill_weights=prefill_weights, decode_weights=decode_weights,
                            prefill_kv_dtype=self.prefill_kv_dtype, decode_kv_dtype=self.decode_kv_dtype,
                            transport=self.transport, threads=self.threads, **common)
        llm = LLM(model, weights="auto" if self.weights_dir else self.weights, prefill_weights=self.prefill_weights,
                  decode_weights=self.decode_weights, kv_dtype=self.kv_dtype, progress=progress, tp=self.tp,
                  threads=self.threads, **common)
        if llm.rank != 0:   # a rank torchrun started: serve rank 0's passes, then leave without running the command
            llm.serve()
            raise typer.Exit(0)
        return llm

    def single_process_twin(self) -> EngineOptions:
        """The one-process configuration nearest to this split: the decode side's KV dtype, each phase's
        weights (what `nano bench --disagg` compares the split against)."""
        prefill_weights, decode_weights = self.split_weights
        return dataclasses.replace(self, disagg=False, kv_dtype=self.decode_kv_dtype, typed=frozenset(),
                                   prefill_weights=prefill_weights, decode_weights=decode_weights)

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain data (for JSON reports): every field but `typed`."""
        return {name: value for name, value in dataclasses.asdict(self).items() if name != "typed"}


# ---- giving a command the flags -------------------------------------------------------------------------------
FLAGS: dict[str, Any] = {   # EngineOptions field -> its flag's Annotated type; defaults are EngineOptions'
    "weights": Weights, "prefill_weights": PrefillWeights, "decode_weights": DecodeWeights, "int4_all": Int4All,
    "dtype": Dtype, "kv_dtype": KvDtype, "kv_budget": KvBudget, "page_size": PageSize, "max_running": MaxRunning,
    "integrity": Integrity, "prefix_cache": PrefixCache, "disagg": Disagg, "prefill_kv_dtype": PrefillKvDtype, "decode_kv_dtype": DecodeKvDtype,
    "transport": Transport, "threads": Threads, "tp": Tp,
}
DEFAULTS = {field.name: field.default for field in dataclasses.fields(EngineOptions)}


def typed_flags(context: typer.Context) -> frozenset[str]:
    """The parameters of the running command whose values the user typed (not defaults)."""
    return frozenset(name for name in context.params
                     if (source := context.get_parameter_source(name)) is not None and source.name == "COMMANDLINE")


def engine_flags(*, skip: tuple[str, ...] = (), keep: tuple[str, ...] | None = None,
                 defaults: dict[str, Any] | None = None) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate a command that takes `engine: EngineOptions` so that it offers every engine flag (less `skip`; or
    only those in `keep`), with EngineOptions' defaults unless `defaults` gives the command its own.

    The command's signature, which Typer reads, loses `engine` and gains one parameter per flag (after the
    command's own) and the Click context. When Typer calls it, the flags' values are gathered into one
    EngineOptions (a flag not offered keeps its default; `typed` names the flags given) and the command runs with
    `engine=` that object."""
    defaults = {**DEFAULTS, **(defaults or {})}
    unknown = (set(skip) | set(keep or ()) | (set(defaults) - set(DEFAULTS))) - set(FLAGS)
    if unknown:
        raise ValueError(f"engine_flags: no such flags {sorted(unknown)}")
    names = [name for name in FLAGS if name not in skip and (keep is None or name in keep)]

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        if "engine" not in signature.parameters:
            raise TypeError(f"{command.__name__} must take an `engine: EngineOptions` parameter")
        own = [parameter for parameter in signature.parameters.values() if parameter.name != "engine"]
        flags = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=FLAGS[name],
                                   default=defaults[name]) for name in names]
        # the Click context tells which flags were typed: the command's own `typer.Context` parameter, or one added
        context_name = next((p.name for p in own if p.annotation is typer.Context), None)
        added = [] if context_name else [inspect.Parameter("click_context", inspect.Parameter.KEYWORD_ONLY,
                                                           annotation=typer.Context)]

        @functools.wraps(command)
        def with_engine(*args: Any, **kwargs: Any) -> None:
            values = {name: kwargs.pop(name) for name in names if name in kwargs}
            if isinstance(values.get("dtype"), DType):
                values["dtype"] = values["dtype"].value
            context = kwargs[context_name] if context_name else kwargs.pop("click_context")
            typed = typed_flags(context) & set(names)
            return command(*args, **kwargs, engine=EngineOptions(**values, typed=typed))

        parameters = [*own, *flags, *added]
        with_engine.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        with_engine.__annotations__ = {p.name: p.annotation for p in parameters}    # resolved, for Typer
        return with_engine
    return decorate
