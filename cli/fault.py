"""`nano fault MODEL --corrupt-page-table` (and friends): break the KV bookkeeping on purpose and watch what the
integrity check does about it. A golden run first, then the same requests with the fault injected mid-decode.
`--kill-prefill` and `--corrupt-transfer` do the same to the prefill/decode split (nano/disagg/)."""
from __future__ import annotations

import functools
import inspect
import json
import os
import random
import sys
import textwrap
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from nano.errors import NanoError

if TYPE_CHECKING:   # the engine (torch) loads once the command line is checked
    from nano.disagg import SplitLLM
    from nano.sampling import SamplingParams

from .console import UsageError, err, out, user_errors
from .faults import (AT_LOOKUP, CACHE_FAULTS, DETECTABLE, FAULT_KINDS, FaultScenario, TrialOutcome,
                     corrupt_next_transfer, run_scenario)
from .options import SEED_RANGE, EngineOptions, Model, engine_flags, flag, typed_flags

REFUSED = {"late-write", *AT_LOOKUP}   # detected by refusing the stale write or the cache entry, nobody aborted
WHY_UNDETECTED = {
    "stale-tag": "the page was reallocated without bumping its tag, so the victim's (page, tag) pair still matches "
                 "and the check cannot see the reuse: this is why every allocation bumps the tag",
    "kv-bitflip": "tags protect the mapping (which page, which allocation a request reads), not the bytes inside a "
                  "page; only a page in the prefix cache has a checksum of its bytes, checked when a request takes "
                  "it (--corrupt-shared-page): a bit flip in a page a request already holds is not detected",
    **dict.fromkeys(("bad-write-slot", "table-after-check"),
                    "the check runs before the pass, on the page tables the pass is then built from: a batch changed "
                    "after it (which no code in nano does) goes unseen; docs/integrity.md says why the per-layer "
                    "guard that once caught this was removed"),
}
REFUSALS = {"late-write": "the stale write was refused: the pages' tags are no longer the writer's",
            "stale-cache-entry": "the cache entry was refused when it was looked up (its page's tag is no longer the "
                                 "one it was cached with): forgotten, and the requests computed the prefix themselves",
            "corrupt-shared-page": "the cache entry was refused when it was looked up (its page's bytes no longer give "
                                   "the checksum taken when it was cached): forgotten, and the requests computed the "
                                   "prefix themselves"}
SPLIT_FAULTS = {"kill-prefill": "the prefill worker is killed (SIGKILL) while requests are in flight",
                "corrupt-transfer": "one byte of a request's KV is flipped after prefill checksummed it"}
RANK_FAULTS = {"kill-rank": "rank 1 of a --tp 2 model is killed (SIGKILL) mid-decode: the run must end with one error "
                            "on rank 0 within the step timeout, never hang"}
ALL_FAULTS = {**FAULT_KINDS, **SPLIT_FAULTS, **RANK_FAULTS}


def fault_table() -> str:
    """The help's list of faults (Click prints a paragraph that starts with \\b as it is)."""
    lines = ["\b", "FAULT, exactly one of:"]
    for kind, detail in ALL_FAULTS.items():
        split = " (prefill/decode split)" if kind in SPLIT_FAULTS else " (tensor parallel)" if kind in RANK_FAULTS \
            else ""
        lines += textwrap.wrap(detail + split, 80, initial_indent=f"  --{kind:<20}", subsequent_indent=" " * 24)
    return "\n".join(lines)


def say(text: str, style: str = "") -> None:
    """One line of the report on stdout, as it is (no markup, not wrapped)."""
    out.print(text, style=style, markup=False, soft_wrap=True)


def listed(indices: list[int]) -> str:
    """[0, 2] -> 'requests 0, 2'; [1] -> 'request 1'."""
    return f"request{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


# ---- which fault, and the flags it takes -------------------------------------------------------------------------
def fault_flags(command: Callable[..., None]) -> Callable[..., None]:
    """Give `command` one flag --KIND per fault, hidden from the options (the help's FAULT table lists them: they
    are one choice), and call it with `chosen`, the kinds given."""
    signature = inspect.signature(command, eval_str=True)
    names = {kind.replace("-", "_"): kind for kind in ALL_FAULTS}
    flags = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=False,
                               annotation=Annotated[bool, typer.Option(f"--{kind}", hidden=True)])
             for name, kind in names.items()]
    parameters = [p for p in signature.parameters.values() if p.name != "chosen"] + flags

    @functools.wraps(command)
    def with_faults(*args: Any, **kwargs: Any) -> None:
        chosen = [kind for name, kind in names.items() if kwargs.pop(name)]
        return command(*args, **kwargs, chosen=chosen)

    with_faults.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    with_faults.__annotations__ = {p.name: p.annotation for p in parameters}    # resolved, for Typer
    return with_faults


def one_fault(chosen: list[str]) -> str:
    """The one fault whose flag was given."""
    if len(chosen) != 1:
        raise UsageError("choose one fault: " + (" and ".join(f"--{kind}" for kind in chosen) + " were given"
                                                 if chosen else "none was given (see 'nano fault -h')"))
    return chosen[0]


def check_fault_flags(kind: str, typed: frozenset[str], engine: EngineOptions, model: str) -> None:
    """Refuse a flag that does nothing with this fault (the split and rank faults run once, the split with its
    own fixed formats and integrity on), and a model name that names no model."""
    engine.check(model)
    if kind in CACHE_FAULTS and not engine.config.prefix_cache:
        raise UsageError(f"--{kind} is a fault of the prefix cache: it needs --prefix-cache")
    if "prefix_cache" in typed and kind in {**SPLIT_FAULTS, **RANK_FAULTS}:
        raise UsageError(f"--{'' if engine.config.prefix_cache else 'no-'}prefix-cache does nothing with --{kind}")
    ignored = ("trials", "integrity", "page_size", "kv_dtype") if kind in SPLIT_FAULTS else \
        ("trials", "integrity", "kv_dtype") if kind in RANK_FAULTS else ()
    given = [name for name in ignored if name in typed]
    if given:
        typed_as = "--no-integrity" if given[0] == "integrity" and not engine.config.integrity else flag(given[0])
        why = "a split fault runs once, integrity on" if kind in SPLIT_FAULTS else "it runs once"
        raise UsageError(f"{typed_as} does nothing with --{kind} ({why})")


# ---- faults of the prefill/decode split --------------------------------------------------------------------------
def split_fault(kind: str, model: str, requests: int, max_tokens: int, seed: int, engine: EngineOptions,
                as_json: bool) -> bool:
    """A fault of the prefill/decode split: a golden split run, then the faulted one. True if the split behaved:
    only the hit requests ended with errors, every other output equals the golden run."""
    from nano.disagg import SplitLLM
    from nano.sampling import SamplingParams
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # no prefix cache: the faulted run repeats the golden run's prompts, and must compute them again for the fault
    # to find them in flight
    with SplitLLM(model, dtype=engine.config.dtype, page_size=16, max_step_tokens=64, seed=seed, timeout_s=60,
                  threads=engine.config.threads, prefix_cache=False) as split:
        prompts = [[rng.randrange(split.config.vocab_size) for _ in range(rng.randint(40, 80))]
                   for _ in range(requests)]
        if not as_json:
            err.print(f"{split.label} · split fault {kind} · prefill pid {split.info['prefill']['pid']}, decode pid "
                      f"{split.info['decode']['pid']} · {requests} requests, {max_tokens} tokens each, greedy",
                      style="bold", markup=False)
        golden = [o.token_ids for o in split.generate(prompts, params)]
        old_pid = split.info["prefill"]["pid"]
        outputs, seconds = faulted_split_run(split, kind, prompts, params)
        aborted = {i: o.error for i, o in enumerate(outputs) if o.finish_reason == "abort"}
        wrong = [i for i, o in enumerate(outputs) if i not in aborted and o.token_ids != golden[i]]
        after = None
        if kind == "kill-prefill":
            split.restart("prefill")
            after = split.generate(prompts[:1], params)[0]
        report = {"model": model, "fault": kind, "detail": SPLIT_FAULTS[kind], "pids": {
                      "prefill": old_pid, "decode": split.info["decode"]["pid"],
                      "prefill_after_restart": split.info["prefill"]["pid"] if after else None},
                  "requests": requests, "aborted": {str(i): e for i, e in aborted.items()},
                  "completed_identical": [i for i in range(requests) if i not in aborted and i not in wrong],
                  "silent_wrong": wrong, "seconds_to_settle": round(seconds, 3),
                  "after_restart": after.finish_reason if after else None}
    identical_after = after is not None and after.token_ids == golden[0]
    healthy = not wrong and bool(aborted) and (kind != "corrupt-transfer" or len(aborted) == 1) and (
        after is None or (after.finish_reason == "length" and identical_after))
    if as_json:
        typer.echo(json.dumps(report))
    else:
        print_split_fault(report, identical_after)
    return healthy


def faulted_split_run(split: SplitLLM, kind: str, prompts: list[list[int]], params: SamplingParams
                      ) -> tuple[list[Any], float]:
    """The golden run's prompts again, with the fault: the outputs, and the seconds every request took to settle
    after it."""
    with corrupt_next_transfer(split) if kind == "corrupt-transfer" else nullcontext():
        submitted = [split.submit(p, params) for p in prompts]
        if kind == "kill-prefill":
            while not any(r.stage == "decode" for r in submitted) and not all(r.output for r in submitted):
                split.poll()
            split.kill("prefill")
        started = time.perf_counter()
        while not all(r.output for r in submitted):
            split.poll()
    return [r.output for r in submitted], time.perf_counter() - started


def print_split_fault(report: dict[str, Any], identical_after: bool) -> None:
    say(f"injected: {report['detail']}")
    for i, error in report["aborted"].items():
        say(f"  request {i}: aborted — {error}", "bold red")
    if report["completed_identical"]:
        say(f"  {listed(report['completed_identical'])}: completed, output identical to the golden run", "green")
    for i in report["silent_wrong"]:
        say(f"  request {i}: completed but differs from the golden run", "bold yellow")
    say(f"  every request settled {report['seconds_to_settle']:.2f} s after the fault (no hang)")
    if report["after_restart"]:
        say(f"  a replacement prefill worker (pid {report['pids']['prefill_after_restart']}) started; a new request "
            f"then finished with '{report['after_restart']}', identical to the golden run: {identical_after}")


# ---- a fault of tensor parallelism -------------------------------------------------------------------------------
def rank_fault(model: str, requests: int, max_tokens: int, seed: int, engine: EngineOptions, as_json: bool) -> bool:
    """Kill rank 1 of a two-rank model mid-decode. True if rank 0 ended the run with one NanoError within the step
    timeout (plus a second of slack)."""
    from nano.parallel import step_timeout_s
    from nano.sampling import SamplingParams
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = engine.replace(tp=2, seed=seed).build(model)
    prompts = [[rng.randrange(llm.config.vocab_size) for _ in range(rng.randint(20, 40))] for _ in range(requests)]
    victim = llm.group.workers[0]
    if not as_json:
        err.print(f"{llm.label} · fault kill-rank · ranks 0 (pid {os.getpid()}) and 1 (pid {victim.pid}) · "
                  f"{requests} requests, {max_tokens} tokens each, greedy", style="bold", markup=False)
    submitted = [llm.submit(p, params) for p in prompts]
    while not any(r.output_token_ids for r in submitted):
        llm.poll()
    victim.kill()
    started, error = time.perf_counter(), None
    try:
        while not all(r.finished for r in submitted):
            llm.poll()
    except NanoError as raised:
        error = str(raised)
    seconds = time.perf_counter() - started
    healthy = error is not None and seconds <= step_timeout_s() + 1
    if as_json:
        typer.echo(json.dumps({"model": model, "fault": "kill-rank", "detail": RANK_FAULTS["kill-rank"],
                               "killed_pid": victim.pid, "error": error, "seconds_to_error": round(seconds, 3),
                               "step_timeout_s": step_timeout_s(), "healthy": healthy}))
        return healthy
    say(f"injected: {RANK_FAULTS['kill-rank']}")
    if error is None:
        say("  the run went on without rank 1: nothing reported it", "bold yellow")
    else:
        say(f"  rank 0 ended the run {seconds:.2f} s after the kill (bound: the {step_timeout_s():.0f} s step "
            f"timeout): {error}", "bold red")
    return healthy


# ---- faults of one engine's bookkeeping --------------------------------------------------------------------------
def engine_fault(kind: str, model: str, trials: int, requests: int, max_tokens: int, seed: int,
                 engine: EngineOptions, as_json: bool) -> bool:
    """`trials` golden runs, each followed by its faulted run on a fresh engine; reports them. True unless, with
    integrity on, a detectable fault went undetected, a request was silently wrong, or a clean one aborted."""
    from nano.engine import Engine
    late = requests if kind in AT_LOOKUP else 0   # the requests that find the stale or corrupt entry
    llm = engine.replace(max_running=requests + 1, seed=seed).build(model, progress=sys.stderr.isatty())
    eos = set(llm.engine.eos_token_ids)
    new_engine = lambda: Engine(llm.model, llm.pool, eos, max_running=requests + late + 1,
                                integrity=engine.config.integrity, prefix_cache=engine.config.prefix_cache)
    # the cache faults' prompts share a prefix of two pages; the AT_LOOKUP ones strike once they have finished
    prefix = 2 * llm.pool.page_size if kind in CACHE_FAULTS else 0
    scenarios = [FaultScenario.random(llm.config.vocab_size, seed * 100_003 + trial, requests=requests,
                                      max_tokens=max_tokens, shared_prefix=prefix, late=late,
                                      inject_step=None if late else max(2, max_tokens // 3))
                 for trial in range(trials)]   # every trial its own prompts, victim and page
    longest = prefix + 40 + max_tokens
    if (requests + late + 1) * longest > llm.pool.tokens:
        raise NanoError(f"the KV pool ({llm.pool.tokens:,} tokens) is too small for --requests {requests} of up "
                        f"to {longest} tokens each; lower --requests or --max-tokens")
    if not as_json:
        err.print(f"{llm.label} · fault {kind} · integrity {'on' if engine.config.integrity else 'off'} · {requests} "
                  f"requests + 1 newcomer{f' + {late} after it with the prefix' if late else ''}, {max_tokens} "
                  f"tokens each, greedy · {trials} trial(s), seed {seed}", style="bold", markup=False)
    outcomes, goldens, tracker = [], [], {"checked": 0, "mismatched": 0, "aborted": 0}
    for trial, scenario in enumerate(scenarios):
        goldens.append(run_scenario(new_engine(), scenario).outputs)
        faulted = new_engine()
        outcomes.append(run_scenario(faulted, scenario, kind, random.Random(seed * 100_003 + trial), goldens[-1]))
        for name in tracker:
            tracker[name] += getattr(faulted.integrity, name)
    counts = {"injected": sum(o.injection is not None for o in outcomes),
              "detected": sum(o.detected for o in outcomes),
              "silent_wrong": sum(bool(o.silent_wrong) for o in outcomes),
              "false_positive": sum(bool(o.false_positive) for o in outcomes)}
    if as_json:
        typer.echo(json.dumps({"model": model, "label": llm.label, "fault": kind, "integrity": engine.config.integrity,
                               "detectable": kind in DETECTABLE, "trials": trials, "seed": seed,
                               "requests": requests + 1, **counts, "tracker": tracker,
                               "per_trial": [trial_record(t, o) for t, o in enumerate(outcomes)]}))
    else:
        print_trials(outcomes, goldens, kind, engine.config.integrity, counts, tracker)
    return not engine.config.integrity or (counts["false_positive"] == 0 and (kind not in DETECTABLE or (
        counts["detected"] == counts["injected"] and counts["silent_wrong"] == 0)))


def first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def trial_record(trial: int, outcome: TrialOutcome) -> dict[str, Any]:
    injection = outcome.injection
    return {"trial": trial, "fault": injection.kind, "victim_request": outcome.victim, "page": injection.page,
            "injected": injection.detail, "detected": outcome.detected,
            "aborted": {str(i): e for i, e in outcome.errors.items()},
            "silent_wrong": outcome.silent_wrong, "false_positive": outcome.false_positive}


def print_trials(outcomes: list[TrialOutcome], goldens: list[list[list[int]]], kind: str, integrity: bool,
                 counts: dict[str, int], tracker: dict[str, int]) -> None:
    """The first trial in full; with more, a table of the counts; then the tracker's totals."""
    print_trial(outcomes[0], goldens[0], kind, integrity)
    if len(outcomes) > 1:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=f"{len(outcomes)} trials", title_justify="left")
        for name in counts:
            table.add_column(name.replace("_", " "), justify="right")
        table.add_row(*(str(v) for v in counts.values()))
        out.print(table)
    say(f"integrity tracker: checked {tracker['checked']:,} request-steps · mismatched page entries "
        f"{tracker['mismatched']:,} · aborted {tracker['aborted']:,}")
    detected = "the stale write or cache entry was refused" if kind in REFUSED else \
        "the victim was aborted by the integrity check"
    say(f"trials count once each: detected = {detected}; silent wrong = some request finished without an error but "
        "differs from the golden run; false positive = the check aborted a request the fault did not touch", "dim")


def print_trial(outcome: TrialOutcome, golden: list[list[int]], kind: str, integrity: bool) -> None:
    say(f"injected: {outcome.injection.detail}")
    if outcome.injection.refused:
        say(f"  detected: {REFUSALS[kind]}", "bold red")
    for i, error in sorted(outcome.errors.items()):
        say(f"  request {i}: aborted — {error}", "bold red" if i == outcome.victim else "")
    for i in outcome.silent_wrong:
        at = first_difference(outcome.outputs[i], golden[i])
        say(f"  request {i}: finished with no error, but its output differs from the golden run from token {at} on "
            f"(golden {golden[i][at:at + 6]}…, got {outcome.outputs[i][at:at + 6]}…): a silent wrong answer",
            "bold yellow")
    others = [i for i in range(len(golden)) if i not in outcome.errors and i not in outcome.silent_wrong]
    if others:
        say(f"  {listed(others)}: output identical to the golden run", "green")
    if not outcome.detected and integrity and kind not in DETECTABLE:
        say(f"  not detected, by design: {WHY_UNDETECTED[kind]}", "dim")
    if not integrity:
        say("  integrity is off (--no-integrity): nothing checks the page tables, so nothing is raised", "dim")


# ---- the command -------------------------------------------------------------------------------------------------
@engine_flags(keep=("dtype", "kv_dtype", "page_size", "integrity", "prefix_cache", "threads"),
              defaults={"page_size": 16})
@fault_flags
def fault(
    context: typer.Context,
    model: Model,
    trials: Annotated[int, typer.Option(metavar="N", min=1, help="Inject the fault N times, each into a fresh run "
                                                                 "of its own scenario (prompts, victim and page).")
                      ] = 1,
    seed: Annotated[int, typer.Option(
        metavar="N", **SEED_RANGE, help="Seed for the prompts and the injections.")] = 0,
    requests: Annotated[int, typer.Option(metavar="N", min=2, help="Requests in the batch (plus one newcomer "
                                                                   "admitted right after the fault).")] = 4,
    max_tokens: Annotated[int, typer.Option(metavar="N", min=2, help="Tokens each request generates (greedy).")
                          ] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with every count and trial.")
                       ] = False,
    *,
    chosen: list[str],
    engine: EngineOptions,
) -> None:
    """Inject one KV bookkeeping fault mid-decode and report what the integrity check did.

    It reports which request was aborted and why, and whether every other request's output equals a clean golden
    run. Exits 1 if, with integrity on, a detectable fault went undetected, a request was silently wrong, or a
    clean request was aborted.
    """
    with user_errors():
        kind = one_fault(chosen)
        check_fault_flags(kind, typed_flags(context), engine, model)
        if kind in SPLIT_FAULTS:
            healthy = split_fault(kind, model, requests, max_tokens, seed, engine, as_json)
        elif kind in RANK_FAULTS:
            healthy = rank_fault(model, requests, max_tokens, seed, engine, as_json)
        else:
            healthy = engine_fault(kind, model, trials, requests, max_tokens, seed, engine, as_json)
    if not healthy:
        raise typer.Exit(1)


# the faults are one choice: listed together in the help text, not as options
fault.__doc__ = f"{inspect.cleandoc(fault.__doc__ or '')}\n\n{fault_table()}"
