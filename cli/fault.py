"""`nano fault MODEL --corrupt-page-table` (and friends): break the KV bookkeeping on purpose and watch what the
integrity check does about it. A golden run first, then the same requests with the fault injected mid-decode.
`--kill-prefill` and `--corrupt-transfer` do the same to the prefill/decode split (nano/disagg/)."""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import random
import sys
import textwrap
import time
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from nano.disagg import SplitLLM
from nano.engine import Engine
from nano.errors import NanoError
from nano.sampling import SamplingParams

from .console import UsageError, err, out, user_errors
from .faults import CACHE_FAULTS, DETECTABLE, FAULT_KINDS, FaultScenario, TrialOutcome, run_scenario
from .options import SEED_RANGE, EngineOptions, Model, engine_flags, typed_flags

REFUSED = {"late-write", "stale-cache-entry"}   # detected by refusing the stale write or entry, nobody aborted
WHY_UNDETECTED = {
    "stale-tag": "the page was reallocated without bumping its tag, so the victim's (page, tag) pair still matches "
                 "and the check cannot see the reuse: this is why every allocation bumps the tag",
    "kv-bitflip": "tags protect the mapping (which page, which allocation a request reads), not the bytes inside a "
                  "page: a bit flip in KV data is not detected; that would take a checksum of the page contents",
}


SPLIT_FAULTS = {"kill-prefill": "the prefill worker is killed (SIGKILL) while requests are in flight",
                "corrupt-transfer": "one byte of a request's KV is flipped after prefill checksummed it"}
RANK_FAULTS = {"kill-rank": "rank 1 of a --tp 2 model is killed (SIGKILL) mid-decode: the run must end with one error "
                            "on rank 0 within the step timeout, never hang"}
ALL_FAULTS = {**FAULT_KINDS, **SPLIT_FAULTS, **RANK_FAULTS}


def FaultFlag(kind: str) -> Any:   # noqa: N802 (a type, like the Annotated types of options.py)
    """The flag `--KIND`: one value of the one choice `nano fault` takes, listed in the help's FAULT table."""
    return Annotated[bool, typer.Option(f"--{kind}", hidden=True)]


def fault_table() -> str:
    """The help's list of faults (Click prints a paragraph that starts with \\b as it is)."""
    lines = ["\b", "FAULT, exactly one of:"]
    for kind, detail in ALL_FAULTS.items():
        split = " (prefill/decode split)" if kind in SPLIT_FAULTS else " (tensor parallel)" if kind in RANK_FAULTS \
            else ""
        lines += textwrap.wrap(detail + split, 80, initial_indent=f"  --{kind:<20}", subsequent_indent=" " * 24)
    return "\n".join(lines)


def split_fault(kind: str, model: str, requests: int, max_tokens: int, seed: int, engine: EngineOptions,
                as_json: bool) -> bool:
    """A fault of the prefill/decode split: a golden split run, then the faulted one. True if the split behaved:
    only the hit requests ended with errors, every other output equals the golden run."""
    from contextlib import nullcontext

    from .faults import corrupt_next_transfer   # the test-only wrapper around the front (faults on the split)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # no prefix cache: the faulted run repeats the golden run's prompts, and must compute them again for the fault
    # to find them in flight
    with SplitLLM(model, dtype=engine.dtype, page_size=16, max_step_tokens=64, seed=seed, timeout_s=60,
                  threads=engine.threads, prefix_cache=False) as split:
        prompts = [[rng.randrange(split.config.vocab_size) for _ in range(rng.randint(40, 80))]
                   for _ in range(requests)]
        if not as_json:
            err.print(f"{split.label} · split fault {kind} · prefill pid {split.info['prefill']['pid']}, decode pid "
                      f"{split.info['decode']['pid']} · {requests} requests, {max_tokens} tokens each, greedy",
                      style="bold", markup=False)
        golden = [o.token_ids for o in split.generate(prompts, params)]
        old_pid = split.info["prefill"]["pid"]
        with corrupt_next_transfer(split) if kind == "corrupt-transfer" else nullcontext():
            submitted = [split.submit(p, params) for p in prompts]
            if kind == "kill-prefill":
                while not any(r.stage == "decode" for r in submitted) and not all(r.output for r in submitted):
                    split.poll()
                split.kill("prefill")
            started = time.perf_counter()
            while not all(r.output for r in submitted):
                split.poll()
        outputs = [r.output for r in submitted]
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
                  "silent_wrong": wrong, "seconds_to_settle": round(time.perf_counter() - started, 3),
                  "after_restart": after.finish_reason if after else None}
    expected_aborts = 1 if kind == "corrupt-transfer" else None
    healthy = not wrong and aborted and (expected_aborts is None or len(aborted) == expected_aborts) and (
        after is None or (after.finish_reason == "length" and after.token_ids == golden[0]))
    if as_json:
        typer.echo(json.dumps(report))
        return bool(healthy)
    out.print(f"injected: {SPLIT_FAULTS[kind]}", markup=False)
    for i, error in aborted.items():
        out.print(f"  request {i}: aborted — {error}", style="bold red", markup=False, soft_wrap=True)
    if report["completed_identical"]:
        identical = report["completed_identical"]
        out.print(f"  request{'s' if len(identical) > 1 else ''} {', '.join(map(str, identical))}: completed, output "
                  f"identical to the golden run", style="green", markup=False, soft_wrap=True)
    for i in wrong:
        out.print(f"  request {i}: completed but differs from the golden run", style="bold yellow", markup=False)
    out.print(f"  every request settled {report['seconds_to_settle']:.2f} s after the fault (no hang)", markup=False)
    if after:
        out.print(f"  a replacement prefill worker (pid {report['pids']['prefill_after_restart']}) started; a new "
                  f"request then finished with '{after.finish_reason}', identical to the golden run: "
                  f"{after.token_ids == golden[0]}", markup=False, soft_wrap=True)
    return bool(healthy)


def rank_fault(model: str, requests: int, max_tokens: int, seed: int, engine: EngineOptions, as_json: bool) -> bool:
    """Kill rank 1 of a two-rank model mid-decode. True if rank 0 ended the run with one NanoError within the step
    timeout (plus a second of slack)."""
    from nano.parallel import step_timeout_s
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = dataclasses.replace(engine, tp=2, seed=seed).build(model)
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
    out.print(f"injected: {RANK_FAULTS['kill-rank']}", markup=False, soft_wrap=True)
    if error is None:
        out.print("  the run went on without rank 1: nothing reported it", style="bold yellow", markup=False)
    else:
        out.print(f"  rank 0 ended the run {seconds:.2f} s after the kill (bound: the {step_timeout_s():.0f} s step "
                  f"timeout): {error}", style="bold red", markup=False, soft_wrap=True)
    return healthy


def first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def trial_record(trial: int, outcome: TrialOutcome) -> dict[str, Any]:
    injection = outcome.injection
    return {"trial": trial, "fault": injection.kind, "victim_request": outcome.victim, "page": injection.page,
            "injected": injection.detail, "detected": outcome.detected,
            "aborted": {str(i): e for i, e in outcome.errors.items()},
            "silent_wrong": outcome.silent_wrong, "false_positive": outcome.false_positive}


def print_trial(outcome: TrialOutcome, golden: list[list[int]], kind: str, integrity: bool) -> None:
    victim = outcome.victim
    out.print(f"injected: {outcome.injection.detail}", markup=False, soft_wrap=True)
    if outcome.injection.refused:
        refusal = {"late-write": "the stale write was refused: the pages' tags are no longer the writer's",
                   "stale-cache-entry": "the cache entry was refused when it was looked up (its page's tag is no "
                                        "longer the one it was cached with): forgotten, and the requests computed "
                                        "the prefix themselves"}[kind]
        out.print(f"  detected: {refusal}", style="bold red", markup=False, soft_wrap=True)
    for i, error in sorted(outcome.errors.items()):
        out.print(f"  request {i}: aborted — {error}", style="bold red" if i == victim else "", markup=False,
                  soft_wrap=True)
    for i in outcome.silent_wrong:
        at = first_difference(outcome.outputs[i], golden[i])
        out.print(f"  request {i}: finished with no error, but its output differs from the golden run from token "
                  f"{at} on (golden {golden[i][at:at + 6]}…, got {outcome.outputs[i][at:at + 6]}…): a silent wrong "
                  f"answer", style="bold yellow", markup=False, soft_wrap=True)
    others = [i for i in range(len(golden)) if i not in outcome.errors and i not in outcome.silent_wrong]
    if others:
        out.print(f"  request{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}: output identical to the golden run", style="green",
                  markup=False, soft_wrap=True)
    if not outcome.detected and integrity and kind not in DETECTABLE:
        out.print(f"  not detected, by design: {WHY_UNDETECTED[kind]}", style="dim", markup=False, soft_wrap=True)
    if not integrity:
        out.print("  integrity is off (--no-integrity): nothing checks the page tables, so nothing is raised",
                  style="dim", markup=False, soft_wrap=True)


@engine_flags(keep=("dtype", "kv_dtype", "page_size", "integrity", "prefix_cache", "threads"),
              defaults={"page_size": 16})
def fault(
    context: typer.Context,
    model: Model,
    corrupt_page_table: FaultFlag("corrupt-page-table") = False,
    use_after_free: FaultFlag("use-after-free") = False,
    double_alloc: FaultFlag("double-alloc") = False,
    stale_tag: FaultFlag("stale-tag") = False,
    kv_bitflip: FaultFlag("kv-bitflip") = False,
    late_write: FaultFlag("late-write") = False,
    bad_write_slot: FaultFlag("bad-write-slot") = False,
    table_after_check: FaultFlag("table-after-check") = False,
    evict_referenced: FaultFlag("evict-referenced") = False,
    stale_cache_entry: FaultFlag("stale-cache-entry") = False,
    kill_prefill: FaultFlag("kill-prefill") = False,
    corrupt_transfer: FaultFlag("corrupt-transfer") = False,
    kill_rank: FaultFlag("kill-rank") = False,
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
    engine: EngineOptions,
) -> None:
    """Inject one KV bookkeeping fault mid-decode and report what the integrity check did.

    It reports which request was aborted and why, and whether every other request's output equals a clean golden
    run. Exits 1 if, with integrity on, a detectable fault went undetected, a request was silently wrong, or a
    clean request was aborted.
    """
    chosen = [kind for kind, on in zip(ALL_FAULTS, (
        corrupt_page_table, use_after_free, double_alloc, stale_tag, kv_bitflip, late_write, bad_write_slot,
        table_after_check, evict_referenced, stale_cache_entry, kill_prefill, corrupt_transfer, kill_rank)) if on]
    typed = typed_flags(context)
    with user_errors():
        if len(chosen) != 1:
            raise UsageError("choose one fault: " + (" and ".join(f"--{kind}" for kind in chosen) + " were given"
                                                     if chosen else "none was given (see 'nano fault -h')"))
        kind = chosen[0]
        engine.check()
        if kind in CACHE_FAULTS and not engine.prefix_cache:
            raise UsageError(f"--{kind} is a fault of the prefix cache: it needs --prefix-cache")
        if "prefix_cache" in typed and kind in {**SPLIT_FAULTS, **RANK_FAULTS}:
            raise UsageError(f"--{'' if engine.prefix_cache else 'no-'}prefix-cache does nothing with --{kind}")
        if kind in SPLIT_FAULTS:   # the split runs once, with its own fixed formats and integrity on
            for name in ("trials", "integrity", "page_size", "kv_dtype"):
                if name in typed:
                    flag = "--no-integrity" if name == "integrity" and not engine.integrity else \
                        "--" + name.replace("_", "-")
                    raise UsageError(f"{flag} does nothing with --{kind} (a split fault runs once, integrity on)")
            healthy = split_fault(kind, model, requests, max_tokens, seed, engine, as_json)
        if kind in RANK_FAULTS:
            for name in ("trials", "integrity", "kv_dtype"):
                if name in typed:
                    raise UsageError(f"--{name.replace('_', '-')} does nothing with --{kind} (it runs once)")
            healthy = rank_fault(model, requests, max_tokens, seed, engine, as_json)
    if kind in SPLIT_FAULTS or kind in RANK_FAULTS:
        if not healthy:
            raise typer.Exit(1)
        return
    integrity = engine.integrity
    with user_errors():
        llm = dataclasses.replace(engine, max_running=requests + 1, seed=seed).build(
            model, progress=sys.stderr.isatty())
        eos = set(llm.engine.eos_token_ids)
        late = requests if kind == "stale-cache-entry" else 0   # the requests that find the stale entry
        prefix_cache = engine.prefix_cache
        new_engine = lambda: Engine(llm.model, llm.pool, eos, max_running=requests + late + 1, integrity=integrity,
                                    prefix_cache=prefix_cache)
        # the cache faults' prompts share a prefix of two pages; stale-cache-entry strikes once they have finished
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
            err.print(f"{llm.label} · fault {kind} · integrity {'on' if integrity else 'off'} · {requests} "
                      f"requests + 1 newcomer{f' + {late} after it with the prefix' if late else ''}, {max_tokens} "
                      f"tokens each, greedy · {trials} trial(s), seed {seed}",
                      style="bold", markup=False)
        outcomes, goldens, tracker = [], [], {"checked": 0, "mismatched": 0, "aborted": 0}
        for trial, scenario in enumerate(scenarios):
            goldens.append(run_scenario(new_engine(), scenario).outputs)
            engine = new_engine()
            outcomes.append(run_scenario(engine, scenario, kind, random.Random(seed * 100_003 + trial),
                                         goldens[-1]))
            for name in tracker:
                tracker[name] += getattr(engine.integrity, name)
    counts = {"injected": sum(o.injection is not None for o in outcomes),
              "detected": sum(o.detected for o in outcomes),
              "silent_wrong": sum(bool(o.silent_wrong) for o in outcomes),
              "false_positive": sum(bool(o.false_positive) for o in outcomes)}
    healthy = not integrity or (counts["false_positive"] == 0 and (kind not in DETECTABLE or (
        counts["detected"] == counts["injected"] and counts["silent_wrong"] == 0)))
    if as_json:
        typer.echo(json.dumps({"model": model, "label": llm.label, "fault": kind, "integrity": integrity,
                               "detectable_by_tags": kind in DETECTABLE, "trials": trials, "seed": seed,
                               "requests": requests + 1, **counts, "tracker": tracker,
                               "per_trial": [trial_record(t, o) for t, o in enumerate(outcomes)]}))
    else:
        print_trial(outcomes[0], goldens[0], kind, integrity)
        if trials > 1:
            table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=f"{trials} trials", title_justify="left")
            for name in counts:
                table.add_column(name.replace("_", " "), justify="right")
            table.add_row(*(str(v) for v in counts.values()))
            out.print(table)
        out.print(f"integrity tracker: checked {tracker['checked']:,} request-steps · mismatched page entries "
                  f"{tracker['mismatched']:,} · aborted {tracker['aborted']:,}", markup=False)
        detected = "the stale write or cache entry was refused" if kind in REFUSED else \
            "the victim was aborted by the integrity check"
        out.print(f"trials count once each: detected = {detected}; silent wrong = "
                  "some request finished without an error but differs from the golden run; false positive = the "
                  "check aborted a request the fault did not touch", style="dim", markup=False, soft_wrap=True)
    if not healthy:
        raise typer.Exit(1)


# the faults are one choice: listed together in the help text, not as options
fault.__doc__ = f"{inspect.cleandoc(fault.__doc__ or '')}\n\n{fault_table()}"
