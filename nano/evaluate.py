"""Teacher-forced evaluation: what a KV dtype or a weight format costs in accuracy, on held-out text.

The text is tokenized once, only as far as the settings use. For each context C asked for, its first tokens are
cut into non-overlapping windows of C tokens, and every window is scored on its own from position 0 through the
engine (`LLM.score`: the same pages, KV dtype and chunked prefill as generation). Row t of a window's logits
[C, vocab] predicts the token after it, so the last row predicts the first token of the next window and every token
but the text's first is predicted once. Per context and configuration:

    bits per byte     the predicted tokens' negative log-likelihood in bits over their UTF-8 bytes (comparable
                      across tokenizers; each token's bytes come from the tokenizer's vocabulary, exactly)
    top-1 accuracy    how often the most likely token is the text's next token
    KL                per token, KL(reference || configuration) in nats: the mean and the 99th percentile
    top-1 agreement   how often the configuration's most likely token is the reference's

Then greedy continuations of prompts cut from the same tokens: how many tokens each configuration generates
before its first difference from the reference's continuation.

Every figure has a 95% bootstrap interval. The resampled unit is a window (a prompt for the generation figures),
never a token: neighbouring tokens share their context, so a token-level bootstrap would claim too much
precision. A delta against the reference resamples the same windows on both sides (paired), so what the two
configurations share, such as a window that is hard for both, cancels out.
"""
from __future__ import annotations

import codecs
import dataclasses
import math
import os
import stat
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from nano.errors import NanoError
from nano.llm import LLM
from nano.loader import STANDINS
from nano.sampling import SamplingParams
from nano.settings import MAX_TOKENS
from nano.tokenizer import Tokenizer

HELDOUT_TEXT = STANDINS / "heldout.txt"   # written by tools/train_standin.py beside the trained stand-ins
CONFIDENCE = 0.95
FEW_BLOCKS = 10       # below this many windows (prompts) a bootstrap interval comes out noticeably too narrow
CUT_MARGIN = 64       # tokens read past the last one used, so that a cut in the text cannot change those used


# ---- the text and its bytes -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Text:
    """A UTF-8 text file (see read_text): `evaluate` reads only its start, as far as the settings use."""
    path: str
    name: str = "the text"   # which file, in errors

    def start(self, limit: int) -> tuple[str, int]:
        """The text of the file's first `limit` bytes (less a character they cut short) and the file's size. Only a
        regular file is read: opening a FIFO waits for a writer, and a device such as /dev/zero has no end."""
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):
                raise NanoError(f"{self.name} is not a regular file (a FIFO, a device or a directory is refused)")
            with open(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:   # a FIFO put there since
                data, size = file.read(limit), os.fstat(file.fileno()).st_size          # does not block either
            return codecs.getincrementaldecoder("utf-8")().decode(data, final=len(data) == size), size
        except UnicodeDecodeError as error:
            raise NanoError(f"{self.name} is not UTF-8 text (byte {error.start:,} is not)") from None
        except OSError as error:
            raise NanoError(f"{self.name}: {error.strerror or error}") from None


def read_text(path: Path | str, name: str = "the text") -> Text:
    """A UTF-8 text file, checked here (it exists, is a regular file, is not empty, its first 64 KiB are UTF-8) and
    read by `evaluate` as far as it uses; `name` says which file in errors."""
    text = Text(str(Path(path).expanduser()), name)
    if text.start(2**16)[1] == 0:
        raise NanoError(f"{name} is empty")
    return text


def tokenize(text: Text, tokenizer: Tokenizer, count: int) -> tuple[list[int], list[int], int]:
    """At least `count` tokens from the start of the text (all of them if it has fewer), the bytes each stands for,
    and the file's size. Only the start is read: enough bytes for `count` of the vocabulary's longest tokens and
    CUT_MARGIN more (a cut can change the last tokens before it), and for a character cut short. Refused when the
    tokens' bytes are not exactly the text's (a tokenizer that normalizes the text): bits per byte would not count
    the text's bytes."""
    pieces = tokenizer.token_bytes()
    content, size = text.start((count + CUT_MARGIN) * max(map(len, pieces)) + 3)
    ids = tokenizer.encode(content)
    if b"".join(pieces[i] for i in ids) != content.encode():
        raise NanoError(f"{text.path}: the tokenizer does not reproduce the text's bytes (it normalizes the text), "
                        f"so bits per byte cannot be counted exactly")
    return ids, [len(pieces[i]) for i in ids], size


# ---- what to evaluate ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    contexts: tuple[int, ...] = (256, 1024)   # window sizes, in tokens
    max_tokens: int = 16384       # most tokens predicted per context: windows from the text's first max_tokens + 1
    prompts: int = 16             # greedy continuations: how many prompts ...
    prompt_tokens: int = 64       # ... of how many tokens, cut from the evaluated tokens
    gen_tokens: int = 64          # tokens each continuation generates
    resamples: int = 1000         # bootstrap resamples
    seed: int = 0                 # the bootstrap's seed

    def __post_init__(self) -> None:
        if not self.contexts or min(self.contexts) < 2 or len(set(self.contexts)) != len(self.contexts):
            raise NanoError(f"contexts must be distinct window sizes >= 2 tokens, got {list(self.contexts)}")
        for name in ("max_tokens", "prompt_tokens", "gen_tokens", "resamples"):
            if getattr(self, name) < 1:
                raise NanoError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompts < 2:
            raise NanoError(f"prompts must be >= 2 (one has no spread to resample), got {self.prompts}")
        if self.max_tokens > MAX_TOKENS:
            raise NanoError(f"max_tokens must be <= {MAX_TOKENS:,}, got {self.max_tokens:,}")

    def check_model(self, max_context: int) -> None:
        """What the settings ask of a model whose context is `max_context` tokens (known from its config)."""
        if max(self.contexts) >= max_context:
            raise NanoError(f"a context of {max(self.contexts):,} tokens is more than the model scores at once: "
                            f"{max_context - 1:,} tokens (its context is {max_context:,})")
        if self.prompt_tokens + self.gen_tokens > max_context:
            raise NanoError(f"prompts of {self.prompt_tokens} tokens and continuations of {self.gen_tokens} need "
                            f"{self.prompt_tokens + self.gen_tokens:,} tokens, more than the model's context "
                            f"({max_context:,})")


class EvalProgress(Protocol):
    """What `evaluate` tells of its progress: its plan once the text is tokenized (each configuration that runs,
    and the tokens it puts through the model: `Plan.work`), then the tokens as they are done."""

    def planned(self, configurations: list[tuple[str, int]]) -> None: ...

    def advance(self, tokens: int) -> None: ...


@dataclass(frozen=True)
class Candidate:
    """A configuration to evaluate: its name, how to build it, and a key. Candidates with equal keys (not None)
    are the same configuration and run once; one with the reference's key is the reference."""
    name: str
    build: Callable[[], LLM]
    key: Hashable | None = None


@dataclass(frozen=True)
class Plan:
    """Which tokens each context's windows and each prompt take."""
    ids: list[int]               # the evaluated tokens: the text's first max_tokens + 1
    nbytes: list[int]            # the bytes each of them stands for
    windows: dict[int, int]      # context -> its number of windows
    prompts: list[list[int]]
    gen_tokens: int              # tokens each prompt's greedy continuation generates

    @classmethod
    def make(cls, ids: list[int], nbytes: list[int], settings: Settings, generate: bool = True) -> Plan:
        """`generate` False: no greedy continuations (nothing to compare them with); the settings are checked
        all the same."""
        capped = len(ids) > settings.max_tokens + 1
        ids, nbytes = ids[:settings.max_tokens + 1], nbytes[:settings.max_tokens + 1]
        evaluated = f"{len(ids):,} tokens of text{' (max_tokens caps them)' if capped else ''}"
        windows = {context: (len(ids) - 1) // context for context in settings.contexts}
        for context, count in windows.items():
            if count < 2:   # one window has no spread to resample
                raise NanoError(f"{evaluated}: too few for two windows of {context:,} tokens (and the token after "
                                f"them), the fewest an interval can be estimated from")
        span = len(ids) - settings.prompt_tokens
        if settings.prompts > span + 1:   # more would repeat prompts: work that adds nothing
            raise NanoError(f"{evaluated}: room for {max(span + 1, 0):,} different prompts of "
                            f"{settings.prompt_tokens} tokens, fewer than the {settings.prompts:,} asked for")
        # spread evenly over the evaluated tokens (prompts overlap only when the text is short)
        starts = [i * span // settings.prompts for i in range(settings.prompts)] if generate else []
        return cls(ids, nbytes, windows, [ids[s:s + settings.prompt_tokens] for s in starts], settings.gen_tokens)

    @property
    def work(self) -> int:
        """Tokens through the model per configuration: every window's, then the greedy continuations'."""
        return sum(count * context for context, count in self.windows.items()) + self.generation_work

    @property
    def generation_work(self) -> int:
        """Each prompt and its continuation, in tokens."""
        return sum(len(prompt) + self.gen_tokens for prompt in self.prompts)

    @classmethod
    def work_of(cls, settings: Settings) -> int:
        """`work` on a text long enough for everything the settings ask (a size known before the text is read)."""
        tokens = settings.max_tokens + 1
        return cls.make([0] * tokens, [1] * tokens, settings).work

    def window(self, context: int, w: int) -> tuple[list[int], list[int]]:
        """Window w of `context`: its input tokens and the tokens they predict (the inputs shifted by one)."""
        start = w * context
        return self.ids[start:start + context], self.ids[start + 1:start + context + 1]

    def window_bytes(self, context: int) -> torch.Tensor:
        """[W] bytes of each window's predicted tokens."""
        per_token = torch.tensor(self.nbytes[1:self.windows[context] * context + 1], dtype=torch.float64)
        return per_token.view(-1, context).sum(1)


# ---- measuring one configuration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class WindowFigures:
    """One configuration at one context, per window (sums over its predicted tokens) and per token."""
    nll: torch.Tensor         # [W] negative log-likelihood, nats
    correct: torch.Tensor     # [W] tokens whose top-1 is the text's
    agree: torch.Tensor       # [W] tokens whose top-1 is the reference's
    kl: torch.Tensor          # [W, C] KL(reference || this configuration) per token, nats


@dataclass(frozen=True)
class Measured:
    setup: dict[str, str]                  # what ran: weights per phase, KV dtype, dtype
    windows: dict[int, WindowFigures]      # per context
    continuations: list[list[int]]         # the greedy continuation of each prompt


def setup_of(llm: LLM) -> dict[str, str]:
    return {"prefill_weights": llm.prefill_weights, "decode_weights": llm.decode_weights,
            "kv_dtype": llm.pool.kv_dtype + (f":{llm.pool.kv_layout}" if llm.pool.fp8 else ""),
            "dtype": str(llm.dtype).removeprefix("torch."),
            "matmuls": str(llm.compute_dtype).removeprefix("torch.")}


def measure(llm: LLM, plan: Plan, reference: dict[int, list[torch.Tensor]], keep: bool,
            advance: Callable[[int], None]) -> Measured:
    """Score every window of every context and generate every prompt's continuation (a plan without prompts:
    none). With `keep` (the reference itself) each window's logits are added to `reference`; otherwise they are
    compared with it. `advance(tokens)` follows the work done (see `Plan.work`)."""
    figures = {}
    for context, count in plan.windows.items():
        kept = reference.setdefault(context, []) if keep else reference[context]
        nll, correct, agree = (torch.zeros(count, dtype=torch.float64) for _ in range(3))
        kl = torch.zeros(count, context, dtype=torch.float64)
        for w in range(count):
            inputs, targets = plan.window(context, w)
            logits = llm.score(inputs).cpu()                                          # [C, vocab] fp32
            if keep:
                kept.append(logits)
            logp = logits.double().log_softmax(-1)                                    # [C, vocab]
            ref_logp = kept[w].double().log_softmax(-1)                               # [C, vocab]
            target = torch.tensor(targets)                                            # [C]
            nll[w] = -logp.gather(1, target[:, None]).sum()
            top = logp.argmax(-1)                                                     # [C]
            correct[w] = (top == target).sum()
            agree[w] = (top == ref_logp.argmax(-1)).sum()
            kl[w] = (ref_logp.exp() * (ref_logp - logp)).sum(-1)                      # [C]
            advance(context)
        figures[context] = WindowFigures(nll, correct, agree, kl)
    if not plan.prompts:
        return Measured(setup_of(llm), figures, [])
    greedy = SamplingParams(temperature=0, max_tokens=plan.gen_tokens, ignore_eos=True)
    outputs = llm.generate(plan.prompts, greedy)
    failed = next((o for o in outputs if o.finish_reason == "abort"), None)
    if failed is not None:
        raise NanoError(f"a greedy continuation failed: {failed.error}")
    advance(plan.generation_work)
    return Measured(setup_of(llm), figures, [o.token_ids for o in outputs])


# ---- figures with intervals ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    value: float     # on every window (or prompt)
    low: float       # the bootstrap interval
    high: float


@dataclass(frozen=True)
class Delta:
    """A configuration's figure minus the reference's, both computed on the same resampled windows."""
    value: float
    low: float
    high: float
    verdict: str     # "within noise" when the interval covers 0, else "better" or "worse"


Statistic = Callable[[torch.Tensor], torch.Tensor]   # block indices [R, n] -> one value per row [R]


class Bootstrap:
    """Seeded resamples of n blocks (windows, prompts) with replacement, shared by every statistic computed on
    them: the difference of two statistics on the same resample is a paired difference."""

    def __init__(self, blocks: int, resamples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.samples = torch.randint(blocks, (resamples, blocks), generator=generator)    # [R, n]
        self.everything = torch.arange(blocks)[None]                                       # [1, n]

    def estimate(self, statistic: Statistic) -> Estimate:
        """The statistic on every block, and the central CONFIDENCE share of its values over the resamples."""
        tail = (1 - CONFIDENCE) / 2
        spread = statistic(self.samples).double()                                          # [R]
        low, high = torch.quantile(spread, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
        return Estimate(statistic(self.everything).item(), low, high)

    def delta(self, statistic: Statistic, reference: Statistic, lower_is_better: bool) -> Delta:
        difference = self.estimate(lambda index: statistic(index) - reference(index))
        return Delta(difference.value, difference.low, difference.high, verdict(difference, lower_is_better))


def verdict(difference: Estimate, lower_is_better: bool) -> str:
    if difference.low <= 0 <= difference.high:
        return "within noise"
    return "better" if (difference.high < 0) == lower_is_better else "worse"


def ratio(numerator: torch.Tensor, denominator: torch.Tensor, scale: float = 1.0) -> Statistic:
    """scale * sum(numerator) / sum(denominator) over the resampled blocks; numerator, denominator [n]."""
    return lambda index: scale * numerator[index].sum(-1) / denominator[index].sum(-1)


def quantile(values: torch.Tensor, q: float) -> Statistic:
    """The q-quantile of all the values of the resampled blocks; values [n, k], k values per block."""
    rows = max(1, 2**24 // values.numel())    # torch.quantile takes at most 2**24 values at once

    def statistic(index: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.quantile(values[part].flatten(1), q, dim=1) for part in index.split(rows)])
    return statistic


# ---- the report -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContextFigures:
    """One configuration at one context. The comparisons with the reference are None for the reference itself."""
    context: int
    bits_per_byte: Estimate
    top1_accuracy: Estimate                   # a fraction
    kl_mean: Estimate | None = None           # nats per token
    kl_p99: Estimate | None = None
    top1_agreement: Estimate | None = None    # a fraction
    delta_bits_per_byte: Delta | None = None
    delta_top1_accuracy: Delta | None = None


@dataclass(frozen=True)
class GenerationFigures:
    matched: list[int]                 # per prompt: tokens generated before the first difference from the reference
    median: Estimate
    quartiles: tuple[float, float]     # the 25th and 75th percentiles of `matched`
    identical: int                     # prompts whose whole continuation equals the reference's


@dataclass(frozen=True)
class ConfigurationFigures:
    name: str
    setup: dict[str, str]                          # what ran: weights per phase, KV dtype, dtype
    contexts: list[ContextFigures]
    generation: GenerationFigures | None = None    # None for the reference


@dataclass(frozen=True)
class Windows:
    context: int
    windows: int
    tokens: int      # predicted tokens: windows * context
    bytes: int       # their UTF-8 bytes


@dataclass(frozen=True)
class TextSummary:
    path: str
    bytes: int               # the file's
    tokens: int | None       # the whole text's; None when only its start was read
    evaluated_tokens: int    # the first max_tokens + 1 of them


@dataclass(frozen=True)
class Report:
    label: str               # which model ran (the reference's label)
    device: str
    text: TextSummary
    settings: Settings
    contexts: list[Windows]
    reference: ConfigurationFigures
    configurations: list[ConfigurationFigures]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def context_figures(context: int, boot: Bootstrap, nbytes: torch.Tensor, mine: WindowFigures,
                    reference: WindowFigures | None) -> ContextFigures:
    """nbytes [W]: the bytes of each window's predicted tokens."""
    tokens = torch.full_like(nbytes, context)                                          # [W]
    bits_per_byte = lambda figures: ratio(figures.nll, nbytes, 1 / math.log(2))
    top1 = lambda figures: ratio(figures.correct, tokens)
    own = ContextFigures(context, boot.estimate(bits_per_byte(mine)), boot.estimate(top1(mine)))
    if reference is None:
        return own
    return dataclasses.replace(
        own, kl_mean=boot.estimate(ratio(mine.kl.sum(1), tokens)), kl_p99=boot.estimate(quantile(mine.kl, 0.99)),
        top1_agreement=boot.estimate(ratio(mine.agree, tokens)),
        delta_bits_per_byte=boot.delta(bits_per_byte(mine), bits_per_byte(reference), lower_is_better=True),
        delta_top1_accuracy=boot.delta(top1(mine), top1(reference), lower_is_better=False))


def generation_figures(mine: list[list[int]], reference: list[list[int]], boot: Bootstrap) -> GenerationFigures:
    matched = [next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
               for ours, theirs in zip(mine, reference)]
    values = torch.tensor(matched, dtype=torch.float64)                                # [P]
    q1, q3 = torch.quantile(values, torch.tensor([0.25, 0.75], dtype=torch.float64)).tolist()
    return GenerationFigures(matched, boot.estimate(quantile(values[:, None], 0.5)), (q1, q3),
                             sum(m == len(theirs) for m, theirs in zip(matched, reference)))


def evaluate(text: Text, reference: Candidate, candidates: Sequence[Candidate], settings: Settings = Settings(),
             progress: EvalProgress | None = None) -> Report:
    """Measure the reference and every candidate on `text`, one configuration at a time (each is built, measured
    and dropped; the reference's logits are kept for the KL: tokens x vocab x 4 bytes per context). Without
    candidates the reference is measured alone: its own figures, and no greedy continuations (nothing to compare
    them with)."""
    llm = reference.build()
    settings.check_model(llm.max_context)
    ids, nbytes, size = tokenize(text, llm.tokenizer, settings.max_tokens + 1)
    plan = Plan.make(ids, nbytes, settings, generate=bool(candidates))
    resolve = lambda key: object() if key is None else key     # None: a configuration of its own
    reference_key, keys = resolve(reference.key), [resolve(c.key) for c in candidates]
    runs = {reference_key: reference.name, **{key: c.name for c, key in zip(candidates, keys) if key != reference_key}}
    if progress is not None:
        progress.planned([(name, plan.work) for name in runs.values()])
    advance = progress.advance if progress is not None else lambda tokens: None

    logits: dict[int, list[torch.Tensor]] = {}
    measured = {reference_key: measure(llm, plan, logits, True, advance)}
    label, device = llm.label, str(llm.device)
    llm.close()   # a tensor-parallel model's other ranks end here, so that the next configuration can start its own
    del llm
    for candidate, key in zip(candidates, keys):
        if key not in measured:
            llm = candidate.build()
            measured[key] = measure(llm, plan, logits, False, advance)
            llm.close()

    boots = {context: Bootstrap(count, settings.resamples, settings.seed) for context, count in plan.windows.items()}
    nbytes_per_window = {context: plan.window_bytes(context) for context in plan.windows}
    prompt_boot = Bootstrap(len(plan.prompts), settings.resamples, settings.seed) if plan.prompts else None
    ours = measured[reference_key]

    def figures(name: str, mine: Measured, compare: bool) -> ConfigurationFigures:
        contexts = [context_figures(context, boots[context], nbytes_per_window[context], mine.windows[context],
                                    ours.windows[context] if compare else None) for context in plan.windows]
        generation = generation_figures(mine.continuations, ours.continuations, prompt_boot) \
            if compare and prompt_boot is not None else None
        return ConfigurationFigures(name, mine.setup, contexts, generation)

    return Report(label, device, TextSummary(text.path, size, len(ids) if sum(nbytes) == size else None,
                                             len(plan.ids)),
                  settings, [Windows(context, count, count * context, int(nbytes_per_window[context].sum()))
                             for context, count in plan.windows.items()],
                  figures(reference.name, ours, False),
                  [figures(c.name, measured[key], True) for c, key in zip(candidates, keys)])
