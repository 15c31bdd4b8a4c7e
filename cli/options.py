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
from typing import TYPE_CHECKING, Annotated, Any

import typer

from nano.errors import UsageError
from nano.settings import KV_DTYPES, KV_LAYOUTS, TRANSPORTS, WEIGHT_FORMATS, EngineConfig

if TYPE_CHECKING:   # the engine itself (torch) loads once the command line is checked
    from nano.disagg import SplitLLM
    from nano.llm import LLM


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
    help="KV-cache dtype. auto: the model's dtype; fp8: e4m3, about half the bytes (in the layout below).")]
KvLayout = Annotated[str, typer.Option(
    metavar="token|tensor|tile", rich_help_panel=ENGINE,
    help="How FP8 pages hold a token's latent and rope key. token: a scale per token (580 B a layer); tensor: one "
         "fixed scale per layer (576 B, SGLang and vLLM); tile: a power-of-two scale per quarter of the latent and the "
         "rope key in BF16 (656 B, FlashMLA). See docs/paged-kv.md.")]
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

def flag(setting: str) -> str:
    """A setting as its flag is typed: kv_dtype -> --kv-dtype."""
    return "--" + setting.replace("_", "-")


@dataclass(frozen=True)
class EngineOptions:
    """The engine flags' values: the EngineConfig they map onto, and what only the CLI has (the split's flags,
    which flags were typed)."""
    config: EngineConfig = EngineConfig()
    disagg: bool = False
    prefill_kv_dtype: str = "bf16"
    decode_kv_dtype: str = "fp8"
    transport: str = "shm"
    typed: frozenset[str] = frozenset()   # the settings whose flags the user typed (the rest are defaults)

    def replace(self, **changes: Any) -> EngineOptions:
        """A copy with `changes` applied, each to the config or to the CLI's own fields."""
        own = {name: changes.pop(name) for name in list(changes) if name in OWN_FIELDS}
        return dataclasses.replace(self, config=self.config.replace(**changes), **own)

    def worker_configs(self) -> dict[str, EngineConfig]:
        from nano.disagg import SplitLLM
        return SplitLLM.worker_configs(self.config, self.prefill_kv_dtype, self.decode_kv_dtype, flag)

    @property
    def split_weights(self) -> tuple[str, str]:
        """(prefill, decode) weight formats of a split."""
        configs = self.worker_configs()
        return configs["prefill"].prefill_weights, configs["decode"].decode_weights

    def check(self, model: str | None = None) -> None:
        """Every flag's value and combination, then (given) that `model` names a model, before the model loads
        (torch too, unless --kv-budget or --disagg ask the machine); the error names the flag. A flag that would do
        nothing here is a UsageError (exit 2)."""
        for name, allowed in (("prefill_kv_dtype", KV_DTYPES), ("decode_kv_dtype", KV_DTYPES),
                              ("transport", TRANSPORTS)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"{flag(name)} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        self.check_combination()
        for config in self.worker_configs().values() if self.disagg else (self.config,):
            config.check(flag, pools=2 if self.disagg else 1)
        if model is not None and not self.config.weights_dir:   # (with --weights DIR, any name goes)
            from nano.presets import check_model_name
            check_model_name(model)

    def check_model(self, model: str) -> None:
        """What the flags ask of this model, from its config alone (nothing loads): the KV budget must hold a page
        in every pool's dtype."""
        from nano.llm import resolve_config
        model_config = resolve_config(model, self.config.weights_dir)[1]
        for config in self.worker_configs().values() if self.disagg else (self.config,):
            config.check_fits(model_config, flag)

    def check_combination(self) -> None:
        """Refuse a typed flag that the other flags make pointless, one at a time."""
        typed = self.typed
        if self.disagg and "kv_dtype" in typed:
            raise UsageError("--kv-dtype does nothing with --disagg: the workers take --prefill-kv-dtype and "
                             "--decode-kv-dtype")
        if self.disagg:
            from nano.parallel import launched_ranks   # (torch: with --disagg only)
            if self.config.tp > 1 or launched_ranks() > 1:
                raise UsageError("--disagg and tensor parallelism (--tp, torchrun) do not combine yet")
        fp8_pools = [self.prefill_kv_dtype, self.decode_kv_dtype] if self.disagg else [self.config.kv_dtype]
        if "kv_layout" in typed and self.config.kv_layout != "token" and "fp8" not in fp8_pools:
            raise UsageError("--kv-layout lays out FP8 pages: add --kv-dtype fp8 (with --disagg, --prefill-kv-dtype "
                             "or --decode-kv-dtype fp8)")
        for name in ("prefill_kv_dtype", "decode_kv_dtype", "transport"):
            if not self.disagg and name in typed:
                raise UsageError(f"{flag(name)} needs --disagg (it configures the split's workers)")

    def build(self, model: str, progress: bool = False) -> LLM | SplitLLM:
        self.check(model)
        self.check_model(model)
        from nano.disagg import SplitLLM   # torch: once the flags are checked
        from nano.llm import LLM
        if self.disagg:
            return SplitLLM(model, self.config, prefill_kv_dtype=self.prefill_kv_dtype,
                            decode_kv_dtype=self.decode_kv_dtype, transport=self.transport)
        llm = LLM(model, self.config, progress=progress)
        if llm.rank != 0:   # a rank torchrun started: serve rank 0's passes, then leave without running the command
            llm.serve()
            raise typer.Exit(0)
        return llm

    def single_process_twin(self) -> EngineOptions:
        """The one-process configuration nearest to this split: the decode side's KV dtype, each phase's
        weights (what `nano bench --disagg` compares the split against)."""
        prefill_weights, decode_weights = self.split_weights
        return dataclasses.replace(self, disagg=False, typed=frozenset(), config=self.config.replace(
            kv_dtype=self.decode_kv_dtype, prefill_weights=prefill_weights, decode_weights=decode_weights,
            kv_layout=self.config.kv_layout if self.decode_kv_dtype == "fp8" else "token"))

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain data (for JSON reports): the config's and the CLI's own, but not `typed`."""
        return {**dataclasses.asdict(self.config), **{name: getattr(self, name) for name in OWN_FIELDS[:-1]}}


OWN_FIELDS = ("disagg", "prefill_kv_dtype", "decode_kv_dtype", "transport", "typed")


# ---- giving a command the flags -------------------------------------------------------------------------------
FLAGS: dict[str, Any] = {   # EngineOptions field -> its flag's Annotated type; defaults are EngineOptions'
    "weights": Weights, "prefill_weights": PrefillWeights, "decode_weights": DecodeWeights, "int4_all": Int4All,
    "dtype": Dtype, "kv_dtype": KvDtype, "kv_layout": KvLayout, "kv_budget": KvBudget, "page_size": PageSize,
    "max_running": MaxRunning,
    "integrity": Integrity, "prefix_cache": PrefixCache, "disagg": Disagg, "prefill_kv_dtype": PrefillKvDtype,
    "decode_kv_dtype": DecodeKvDtype,
    "transport": Transport, "threads": Threads, "tp": Tp,
}
DEFAULTS = {**{field.name: field.default for field in dataclasses.fields(EngineConfig)},
            **{name: getattr(EngineOptions, name) for name in OWN_FIELDS}}


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
            return command(*args, **kwargs, engine=EngineOptions().replace(**values, typed=typed))

        parameters = [*own, *flags, *added]
        with_engine.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        with_engine.__annotations__ = {p.name: p.annotation for p in parameters}    # resolved, for Typer
        return with_engine
    return decorate


# ---- --compare KEY=A,B: one parser for nano bench and nano eval -----------------------------------------------
WEIGHT_SETTINGS = ("weights", "prefill_weights", "decode_weights")
COMPARED = {   # each --compare key -> the settings it sets in every configuration (typing their flags does nothing)
    "kv-dtype": ("kv_dtype",), "weights": WEIGHT_SETTINGS, "policy": WEIGHT_SETTINGS,
    "integrity": ("integrity",), "prefix-cache": ("prefix_cache",)}


def compared_settings(key: str, value: str) -> dict[str, Any]:
    """The settings one value of `--compare KEY=…` stands for; a value the key does not take is a UsageError."""
    if key in ("integrity", "prefix-cache"):
        if value not in ("on", "off"):
            raise UsageError(f"--compare {key}= takes on,off; got {value!r}")
        return {key.replace("-", "_"): value == "on"}
    if key == "kv-dtype":   # fp8:LAYOUT names the FP8 layout too (fp8 alone: --kv-layout's)
        dtype, colon, layout = value.partition(":")
        if dtype not in ("auto", *KV_DTYPES) or colon and (dtype != "fp8" or layout not in KV_LAYOUTS):
            raise UsageError(f"--compare kv-dtype= takes auto, {', '.join(KV_DTYPES)} or fp8:LAYOUT (LAYOUT one of "
                             f"{', '.join(KV_LAYOUTS)}); got {value!r}")
        return {"kv_dtype": dtype, **({"kv_layout": layout or "token"} if colon or dtype != "fp8" else {})}
    prefill, slash, decode = value.partition("/") if key == "policy" else (value, "/", value)
    if not slash or prefill not in WEIGHT_FORMATS or decode not in WEIGHT_FORMATS:
        shape = "PREFILL/DECODE formats like bf16/int4" if key == "policy" else "weight formats"
        raise UsageError(f"--compare {key}= takes {shape} ({', '.join(WEIGHT_FORMATS)}); got {value!r}")
    return {"prefill_weights": prefill, "decode_weights": decode}


def parse_compare(text: str, engine: EngineOptions, keys: tuple[str, ...], least: int = 2
                  ) -> list[tuple[str, EngineOptions]]:
    """'kv-dtype=bf16,fp8' -> [("kv-dtype=bf16", engine with kv_dtype bf16), ("kv-dtype=fp8", ...)], each checked.
    `keys`: the keys the command offers; `least`: the values it needs (nano eval: one, set against its reference).
    Refused: another key, a value the key does not take, an empty or repeated value, fewer than `least`, and a
    typed flag that the key sets in every configuration. --int4-all applies to the values with int4 weights."""
    key, _, listed = text.partition("=")
    if key not in keys or not listed:
        raise UsageError(f"--compare takes KEY=A,B,… with KEY one of {', '.join(keys)}; got {text!r}")
    values = listed.split(",")
    if "" in values or len(set(values)) != len(values):
        raise UsageError(f"--compare {text}: a value is empty or listed twice")
    for name in COMPARED[key]:
        if name in engine.typed and not (name == "weights" and engine.config.weights_dir):
            typed_as = f"--no-{flag(name)[2:]}" if getattr(engine.config, name) is False else flag(name)
            raise UsageError(f"{typed_as} does nothing with --compare {key}=…, which sets it in every configuration")
    variants = []
    for value in values:
        settings = compared_settings(key, value)
        if "decode_weights" in settings:
            formats = (settings["prefill_weights"], settings["decode_weights"])
            settings["int4_all"] = engine.config.int4_all and "int4" in formats
        variants.append((f"{key}={value}", engine.replace(**settings)))
    if len(variants) < least:
        raise UsageError(f"--compare needs at least two values, like {key}=A,B")
    if engine.config.int4_all and not any(variant.config.int4_all for _, variant in variants):
        raise UsageError(f"--int4-all needs int4 weights, and no value of --compare {text} has them")
    for _, variant in variants:
        variant.check()
    return variants
