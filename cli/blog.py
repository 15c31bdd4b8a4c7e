"""`nano bench MODEL --reproduce-blog`: the published results' shape, at small scale, in one run.

The production report (Kimi K2.6 and GLM-5.2 on H200 nodes) made three claims; each becomes a back-to-back
comparison on the nano stand-in, measured in this one process:

1. FP8 KV holds twice the tokens: under one KV budget BF16 saturates at half the concurrency FP8 reaches, and FP8's
   peak throughput is higher. Twice exactly: the report's FP8 cache is SGLang's and vLLM's, one scale per layer,
   so every FP8 KV run here (KV, integrity, accuracy) uses that page layout, FP8_KV_LAYOUT ("tensor").
2. INT4 weights speed decode up (bandwidth-bound, batch 1) and slow prefill down (compute-bound).
3. The KV integrity check costs under 1% of throughput and p95 latency.

and one about all of them: none costs accuracy (MMLU 89.11 with FP8 KV against 89.04; every score within one point).
The accuracy rows run `nano eval` (nano/evaluate.py) on the preset's trained stand-in.

Absolute numbers differ by orders of magnitude (two CPU cores against eight H200s); the ratios are the claim.
Timings on a shared machine are only meaningful as ratios measured in one run, interleaved, with their noise:

  * INT4 vs FP8 weights: both engines stay loaded and take turns in 8 pairs, in the order A-B, B-A, A-B,
    ... Each pair gives one ratio (decode: tokens/s from the median gap between a request's tokens; prefill: the
    fastest of three 512-token prompts, so a stall of the machine inflates no sample). The figure is the median of
    the 8 paired ratios, shown with their range. The verdict is a sign test: "yes" when at least 7 of the 8 pairs
    lie on the published side of 1 (chance under no effect: 9/256 = 3.5%), "no" when at least 7 lie on the other
    side, "within noise" otherwise.
  * FP8 vs BF16 KV throughput and integrity on vs off: whole runs of 128 requests, in the order A, B, B, A. The
    noise is how far the two runs of one configuration differ; a difference between the configurations smaller
    than that is "within noise", a larger one "yes" or "no".

Every figure says how it was obtained:
  * quoted: the published column, from the report;
  * measured: run here, in this process, on the device named in the title;
  * by construction: fixed by how the experiment is set up, so it is shown but gets no verdict. The KV capacity
    ratio is the pool's arithmetic (BF16 bytes per token over FP8's), and the BF16 saturation at 32 requests
    is the budget this module sizes for 32 BF16 requests (FP8 then fits what its pool holds, capped by the 64
    in flight).
The INT4 rows compare INT4 routed experts (the rest BF16, Kimi's recipe) with resident FP8 weights (every Linear
but the lm_head and kv_b_proj, as GLM-5.2's FP8 release holds them), as the report does. On a CPU, which has no
FP8 arithmetic, FP8 weights are dequantized at every call, so a CPU run measures that and not the GPU kernels:
the rows name the device that measured them (benchmarks/gpu.py is the GPU measurement).

Only bench.py imports this module; it imports the load generator (loadgen.py) and nothing that imports it.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from math import comb
from typing import TYPE_CHECKING, Any, Literal

import torch
from rich import box
from rich.table import Table

from nano.evaluate import HELDOUT_TEXT, Candidate, Plan, Settings, evaluate, read_text
from nano.llm import resolve_config
from nano.loader import trained_record
from nano.presets import PRESETS, RANDOM_SUFFIX

from .console import out
from .loadgen import Workload, drive, measure
from .machine import device_name
from .options import EngineOptions

if TYPE_CHECKING:   # for annotations only
    from .progress import Phase, Progress

# the report's figures (Kimi K2.6 for KV and integrity, GLM-5.2 for weights)
PUBLISHED = {
    "kv_capacity_ratio": 1_370_000 / 686_000,      # tokens in memory, FP8 / BF16
    "bf16_saturation": 32, "fp8_concurrency": 64,  # concurrent requests
    "kv_peak_throughput_ratio": 2192 / 1558,       # tok/s at each one's peak
    "int4_decode_ratio": 92 / 60,                  # decode tok/s at batch 1, INT4 / FP8 (+55%)
    "int4_prefill_ratio": 8660 / 10160,            # prefill tok/s, INT4 / FP8
    "integrity_throughput_cost": (0.0038, 0.0079),
    "integrity_p95_cost": (0.0042, 0.0080),
}
# accuracy (nano eval on the trained stand-in): 16 windows of 512 held-out tokens, 8 greedy continuations
ACCURACY_SETTINGS = Settings(contexts=(512,), max_tokens=8192, prompts=8, prompt_tokens=64, gen_tokens=32)
ACCURACY_KEYS = ("fp8_kv_top1_delta", "int4_top1_delta")
KV_REQUESTS_BF16 = 32      # the KV budget is sized so that BF16 holds this many requests; twice as many are in flight
# The FP8 page layout of every FP8 KV run here (KV, integrity, accuracy): the one the report's capacity figure is
# arithmetic of. 686k -> 1.37M is exactly 2x BF16's tokens, 1 byte a value and no per-token scale: SGLang's and
# vLLM's FP8 MLA cache, one scale per layer (nano/kv.py's "tensor"; nano's default "token" would hold 1.986x).
FP8_KV_LAYOUT = "tensor"
PAGE_SIZE = 16
BY_CONSTRUCTION = {"kv_capacity_ratio", "bf16_saturation"}   # fixed by the set-up: shown, never given a verdict
WEIGHT_PAIRS = 8           # INT4 vs FP8: paired samples, A-B then B-A ...; a sign test over them
PREFILL_REPEATS = 3        # prefill prompts per sample; the sample is the fastest (a stall inflates none)
SIGN_TEST_LEVEL = 0.05     # one-sided: the chance that a coin gives at least this many pairs on one side
LOAD = 128, 40, 8          # the KV and integrity runs: requests, prompt tokens, output tokens
KV_ORDER = ("bf16", "fp8", "fp8", "bf16")
INTEGRITY_ORDER = (True, False, False, True)
DECODE, PREFILL = (16, 32), (512, 1)    # the INT4 vs FP8 samples: prompt tokens, output tokens
ACCURACY_RUNS = ("reference", "fp8 kv", "int4 weights")
# Seconds each phase of this plan took on 2 idle cores with glm-5.2-random, measured here (docs/bench.md's AVX2
# EPYC, nothing else running, load average 0.9 at the start; from its stderr's phase lines), with the 2 threads nano
# picks there: the plan line's "about N min on 2 idle cores". (With --threads 1 the same run took 239 s, not 391.)
# The random stand-ins share one body, so any of them gets it; another model (its size unknown) gets none.
IDLE_S = {"KV run": 21.0, "weights": 205.0, "integrity run": 16.8, "accuracy": 35.0}


def blog_phases(model: str) -> list[Phase]:
    """The plan (cli/progress.py): the runs of each experiment in order, their units weighed by the tokens they
    put through the model."""
    from .progress import Phase

    requests, prompt, output = LOAD
    runs = [1, 1, 2, 2]
    pair = 2 * (sum(DECODE) + PREFILL_REPEATS * sum(PREFILL))
    idle = IDLE_S if model.endswith(RANDOM_SUFFIX) else dict.fromkeys(IDLE_S, 0.0)
    return [*(Phase(f"KV {kv_dtype}, run {run} of 2", requests, work=prompt + output, idle_s=idle["KV run"])
              for kv_dtype, run in zip(KV_ORDER, runs)),
            Phase("INT4 vs FP8 weights", WEIGHT_PAIRS, "pairs", work=pair, idle_s=idle["weights"]),
            *(Phase(f"integrity {'on' if on else 'off'}, run {index + 1} of 4", requests, work=prompt + output,
                    idle_s=idle["integrity run"]) for index, on in enumerate(INTEGRITY_ORDER)),
            *([Phase("accuracy: nano eval", len(ACCURACY_RUNS) * Plan.work_of(ACCURACY_SETTINGS), "tokens",
                     idle_s=idle["accuracy"])] if accuracy_model(model) is not None else [])]


def kv_experiment(model: str, base: EngineOptions, seed: int, progress: Progress) -> dict[str, Any]:
    """64 in flight under a budget that fits 32 requests in BF16; 40 + 8 tokens fill three pages exactly, so a
    request needs the same pages from admission to the end and the peak is set by capacity alone. Both engines
    stay loaded and run in the order bf16, fp8, fp8, bf16, so a drift in the machine's speed cancels out."""
    config = resolve_config(model, base.config.weights_dir)[1]
    budget = KV_REQUESTS_BF16 * 3 * PAGE_SIZE * config.kv_bytes_per_token("bf16")
    requests, prompt, output = LOAD
    workload = Workload.random(requests, (prompt, prompt), (output, output), config.vocab_size, seed)
    engines = {kv_dtype: base.replace(kv_dtype=kv_dtype, kv_layout=layout, kv_budget=str(budget),
                                      page_size=PAGE_SIZE).build(model)
               for kv_dtype, layout in (("bf16", "token"), ("fp8", FP8_KV_LAYOUT))}   # BF16: its only layout
    runs = {}
    for index, kv_dtype in enumerate(KV_ORDER):
        run = 1 if index in (0, 1) else 2
        runs[f"{kv_dtype}, run {run}"] = measure(engines[kv_dtype], workload, 2 * KV_REQUESTS_BF16,
                                                 4 if index < 2 else 0, progress.advance)
    return runs


def weights_experiment(model: str, base: EngineOptions, seed: int, progress: Progress) -> dict[str, Any]:
    """Decode: one request at a time, a 16-token prompt and 32 tokens (tokens/s from the median gap between its
    tokens). Prefill: 512-token prompts one at a time (prompt tokens/s of the fastest of PREFILL_REPEATS). Both
    engines stay loaded and take turns in WEIGHT_PAIRS pairs, fp8 first in even pairs and int4 first in odd ones;
    returns every sample, by format."""
    config = resolve_config(model, base.config.weights_dir)[1]
    (decode_in, decode_out), (prefill_in, prefill_out) = DECODE, PREFILL
    decode = Workload.random(1, (decode_in, decode_in), (decode_out, decode_out), config.vocab_size, seed)
    prefill = Workload.random(PREFILL_REPEATS, (prefill_in, prefill_in), (prefill_out, prefill_out),
                              config.vocab_size, seed)
    engines = {weights: base.replace(weights=weights, dtype=base.config.dtype or "bfloat16").build(model)
               for weights in ("fp8", "int4")}
    # warm-up: the first prefill and the first decode step of an engine cost extra; one prompt of the prefill's
    # length and two tokens pass through both
    for llm in engines.values():
        drive(llm, Workload(prefill.prompts[:1], [2]), 1)
    samples: dict[str, dict[str, list[float]]] = {w: {"decode_tok_s": [], "prefill_tok_s": []} for w in engines}
    for pair in range(WEIGHT_PAIRS):
        for weights in ("fp8", "int4") if pair % 2 == 0 else ("int4", "fp8"):
            (request,), _ = drive(engines[weights], decode, 1)
            gaps = [later - earlier for earlier, later in zip(request.token_times, request.token_times[1:])]
            samples[weights]["decode_tok_s"].append(1 / statistics.median(gaps))
            prefilled, _ = drive(engines[weights], prefill, 1)
            samples[weights]["prefill_tok_s"].append(max(len(r.prompt_token_ids) / (r.token_times[0] - r.arrival_time)
                                                         for r in prefilled))
        progress.advance()
    return samples


def paired_ratios(samples: dict[str, dict[str, list[float]]], figure: str) -> list[float]:
    """INT4 over FP8, pair by pair."""
    return [int4 / fp8 for fp8, int4 in zip(samples["fp8"][figure], samples["int4"][figure])]


def sign_test(ratios: list[float], claim_above: bool, level: float = SIGN_TEST_LEVEL) -> bool | None:
    """True when enough pairs lie on the claimed side of 1 that a coin (no effect) would put as many there with a
    chance of at most `level`; False when as many lie on the other side; None (within noise) otherwise. With 8
    pairs it takes 7."""
    need = sign_need(len(ratios), level)
    above, below = sum(r > 1 for r in ratios), sum(r < 1 for r in ratios)
    claimed, other = (above, below) if claim_above else (below, above)
    return True if claimed >= need else False if other >= need else None


def beyond_noise(ratio: float, noise: float, claim_above: bool) -> bool | None:
    """A ratio between two configurations against the noise between two runs of one: True when it lies on the
    claimed side of 1 by more than the noise, False when on the other side by more, None (within noise) otherwise."""
    if abs(ratio - 1) <= noise:
        return None
    return (ratio > 1) == claim_above


def integrity_experiment(model: str, base: EngineOptions, seed: int, progress: Progress) -> dict[str, Any]:
    """The KV experiment's FP8 load with the check on and off on one engine (the same weights and pool, so only
    the check differs), in the order on, off, off, on: a drift in the machine's speed cancels out."""
    config = resolve_config(model, base.config.weights_dir)[1]
    requests, prompt, output = LOAD
    workload = Workload.random(requests, (prompt, prompt), (output, output), config.vocab_size, seed)
    llm = base.replace(kv_dtype="fp8", kv_layout=FP8_KV_LAYOUT, page_size=PAGE_SIZE).build(model)
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for index, on in enumerate(INTEGRITY_ORDER):
        llm.engine.set_integrity(on)
        runs["on" if on else "off"].append(measure(llm, workload, 2 * KV_REQUESTS_BF16, 4 if index == 0 else 0,
                                                   progress.advance))
    return runs


def accuracy_model(model: str) -> str | None:
    """The model the accuracy rows measure: the trained stand-in of the preset (random weights have no accuracy
    to lose), or the checkpoint itself; None when the preset has no trained stand-in."""
    base = model.removesuffix(RANDOM_SUFFIX)
    if base in PRESETS:
        return base if trained_record(base) is not None else None
    return model


def accuracy_experiment(model: str, base: EngineOptions, seed: int, progress: Progress) -> dict[str, Any] | None:
    """`nano eval` on the trained stand-in, in BF16: FP8 KV against BF16 KV, and INT4 routed experts against BF16
    weights, teacher-forced over the held-out text (ACCURACY_SETTINGS), against one BF16 reference."""
    target = accuracy_model(model)
    if target is None:
        return None
    bf16 = base.replace(dtype="bfloat16", kv_dtype="bf16", kv_layout="token", weights="bf16", prefill_weights=None,
                        decode_weights=None, int4_all=False, page_size=PAGE_SIZE, typed=frozenset())
    configurations = dict(zip(ACCURACY_RUNS, (bf16, bf16.replace(kv_dtype="fp8", kv_layout=FP8_KV_LAYOUT),
                                              bf16.replace(weights="int4"))))
    settings = dataclasses.replace(ACCURACY_SETTINGS, seed=seed)
    candidates = [Candidate(name, lambda options=options: options.build(target), name)
                  for name, options in configurations.items()]
    from .progress import EvalProgress

    report = evaluate(read_text(HELDOUT_TEXT), candidates[0], candidates[1:], settings, EvalProgress(progress))
    figures = {run.name: run.contexts[0] for run in report.configurations}
    return {"model": report.label, "settings": dataclasses.asdict(settings), "report": report.as_dict(),
            "top1_delta": {name: dataclasses.asdict(f.delta_top1_accuracy) for name, f in figures.items()},
            "bits_per_byte_delta": {name: dataclasses.asdict(f.delta_bits_per_byte) for name, f in figures.items()}}


def within_a_point(delta: dict[str, float]) -> bool | None:
    """The report's accuracy claim is "within one point": True when the whole 95% interval of the change in top-1
    accuracy lies within ±1 point, False when it lies wholly beyond a point, None (undecided) when it straddles."""
    low, high = 100 * delta["low"], 100 * delta["high"]
    if -1 < low and high < 1:
        return True
    return False if high < -1 or low > 1 else None


def reproduce(model: str, base: EngineOptions, seed: int) -> dict[str, Any]:
    """Run the four experiments (the plan's phases, cli/progress.py), print the published figures beside the
    measured ones with a verdict each, and return them all."""
    from .progress import Progress

    with Progress(blog_phases(model)) as progress:
        runs = {"kv": kv_experiment(model, base, seed, progress),
                "weights": weights_experiment(model, base, seed, progress),
                "integrity": integrity_experiment(model, base, seed, progress),
                "accuracy": accuracy_experiment(model, base, seed, progress)}
    measured = measured_figures(runs)
    holds = verdicts(measured)
    # LLM puts the model on the GPU when there is one (nano/llm.py): that is what the runs measured
    on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = device_name(on)
    weights = runs["weights"]
    decode_tok_s = {w: statistics.median(weights[w]["decode_tok_s"]) for w in weights}
    prefill_tok_s = {w: statistics.median(weights[w]["prefill_tok_s"]) for w in weights}
    rows = blog_rows(measured, decode_tok_s, prefill_tok_s, "GPU" if on.type == "cuda" else "CPU")
    out.print(blog_table(rows, holds, device))
    out.print(blog_note(measured, device, runs["accuracy"]), style="dim", markup=False, soft_wrap=True)
    return {"mode": "reproduce-blog", "fp8_kv_layout": FP8_KV_LAYOUT, "published": PUBLISHED, "measured": measured,
            "holds": holds, "obtained": {row.key: row.obtained for row in rows}, "measured_on": device, "runs": runs}


def measured_figures(runs: dict[str, Any]) -> dict[str, Any]:
    """The experiments' runs as the published figures' counterparts, with the run-to-run noise and the paired
    ratios each verdict is drawn from."""
    kv, weights, integrity, accuracy = runs["kv"], runs["weights"], runs["integrity"], runs["accuracy"]

    def median(runs: list[dict[str, Any]], get: Any) -> float:
        return statistics.median(get(r) for r in runs)

    def spread(pairs: list[tuple[dict[str, Any], dict[str, Any]]], get: Any) -> float:
        """How far two runs of the same configuration differ, relative: what end-to-end costs can resolve."""
        return max(abs(get(a) / get(b) - 1) for a, b in pairs)

    tok_s = lambda r: r["total_tok_s"]
    p95 = lambda r: r["latency_ms"]["tpot"]["p95"]
    kv_pairs = [(kv["bf16, run 1"], kv["fp8, run 1"]), (kv["bf16, run 2"], kv["fp8, run 2"])]
    kv_ratios = [fp8["output_tok_s"] / bf16["output_tok_s"] for bf16, fp8 in kv_pairs]
    ratios = {"int4_decode_ratio": paired_ratios(weights, "decode_tok_s"),
              "int4_prefill_ratio": paired_ratios(weights, "prefill_tok_s"), "kv_peak_throughput_ratio": kv_ratios}
    on_off = list(zip(integrity["on"], integrity["off"]))
    measured = {
        "kv_capacity_ratio": kv["fp8, run 1"]["kv"]["capacity_tokens"] / kv["bf16, run 1"]["kv"]["capacity_tokens"],
        "bf16_saturation": max(kv[f"bf16, run {i}"]["peak_running"] for i in (1, 2)),
        "fp8_concurrency": max(kv[f"fp8, run {i}"]["peak_running"] for i in (1, 2)),
        "kv_peak_throughput_ratio": statistics.median(kv_ratios),
        "int4_decode_ratio": statistics.median(ratios["int4_decode_ratio"]),
        "int4_prefill_ratio": statistics.median(ratios["int4_prefill_ratio"]),
        "integrity_throughput_cost": 1 - median(integrity["on"], tok_s) / median(integrity["off"], tok_s),
        "integrity_share_of_step": median(integrity["on"], lambda r: r["integrity"]["share_of_step_time"]),
        "integrity_p95_cost": median(integrity["on"], p95) / median(integrity["off"], p95) - 1,
        "run_to_run_noise": {
            "throughput": spread(on_off, tok_s), "p95": spread(on_off, p95),
            "kv_throughput": spread([(kv["bf16, run 1"], kv["bf16, run 2"]), (kv["fp8, run 1"], kv["fp8, run 2"])],
                                    lambda r: r["output_tok_s"])},
        "paired_ratios": ratios,
    }
    if accuracy is not None:
        measured["fp8_kv_top1_delta"] = accuracy["top1_delta"]["fp8 kv"]
        measured["int4_top1_delta"] = accuracy["top1_delta"]["int4 weights"]
    return measured


def verdicts(measured: dict[str, Any]) -> dict[str, bool | None]:
    """Whether each measured figure holds the published shape: yes, no or within noise (None). Only measured
    figures get one; end to end, a cost smaller than the noise between two identical runs is not a finding."""
    ratios, noise = measured["paired_ratios"], measured["run_to_run_noise"]
    return {
        "kv_peak_throughput_ratio": beyond_noise(measured["kv_peak_throughput_ratio"], noise["kv_throughput"],
                                                 claim_above=True),
        "int4_decode_ratio": sign_test(ratios["int4_decode_ratio"], claim_above=True),
        "int4_prefill_ratio": sign_test(ratios["int4_prefill_ratio"], claim_above=False),
        "integrity_share_of_step": measured["integrity_share_of_step"] < 0.01,
        "integrity_throughput_cost": within(measured["integrity_throughput_cost"], noise["throughput"]),
        "integrity_p95_cost": within(measured["integrity_p95_cost"], noise["p95"]),
        **{key: within_a_point(measured[key]) for key in ACCURACY_KEYS if key in measured},
    }


def blog_note(measured: dict[str, Any], device: str, accuracy: dict[str, Any] | None) -> str:
    """The line under the table: where each kind of figure comes from and how a verdict is reached."""
    settings = ACCURACY_SETTINGS
    accuracy_note = (
        f" Accuracy rows: nano eval on {accuracy['model']}, BF16, teacher-forced over the first "
        f"{settings.max_tokens:,} held-out tokens in windows of {settings.contexts[0]}; the change in next-token "
        f"top-1 accuracy against BF16 weights and KV, with its 95% paired-bootstrap interval over windows; yes when "
        f"the whole interval lies within ±1 point (the report: every score within one point), no when it lies "
        f"beyond, within noise otherwise. The published figure is MMLU, a different test: the comparison is of "
        f"the claim, not the number." if accuracy else
        " Accuracy rows: not measured, this preset has no trained stand-in (random weights have no accuracy).")
    return (f"published: quoted from the report, Kimi K2.6 (KV, integrity) and GLM-5.2 (weights) on H200 nodes. "
            f"FP8 KV rows: the {FP8_KV_LAYOUT} layout, as SGLang and vLLM store it (1 byte a value, one scale per "
            f"layer), the cache the report's 686k → 1.37M counts. measured: the nano stand-in on {device}, in this "
            f"process. by construction: fixed by the set-up (the budget holds {KV_REQUESTS_BF16} BF16 requests; the "
            f"same bytes hold {measured['kv_capacity_ratio']:.2f}× the tokens in FP8), so no verdict. INT4 rows: the "
            f"median of {WEIGHT_PAIRS} paired ratios (the two engines take turns); spread: their range; yes/no when at "
            f"least {sign_need(WEIGHT_PAIRS)} of the {WEIGHT_PAIRS} pairs agree (a sign test at "
            f"{100 * SIGN_TEST_LEVEL:.0f}%), within noise otherwise. They compare INT4 routed experts with resident "
            f"FP8 weights, both measured on {device}; a CPU has no FP8 arithmetic and dequantizes FP8 weights at "
            "every call, so a CPU measures that, not the report's GPU kernels. KV throughput and integrity: runs in "
            "the order A, B, B, A; spread: ± how far two runs of the same setting differ (the noise), and a "
            "difference inside it is within noise. The check's own time is measured too (the engine times it every "
            "step)."
            + accuracy_note)


def sign_need(n: int, level: float = SIGN_TEST_LEVEL) -> int:
    """Pairs out of n that must agree for the sign test to call it (n + 1: never)."""
    return next((k for k in range(n + 1) if sum(comb(n, j) for j in range(k, n + 1)) / 2 ** n <= level), n + 1)


def within(cost: float, noise: float) -> bool | None:
    """True: under 1% and resolved; False: resolved and 1% or more; None: hidden in the run-to-run noise."""
    if abs(cost) <= noise:
        return None if noise >= 0.01 else True
    return cost < 0.01


@dataclass(frozen=True)
class BlogRow:
    technique: str
    figure: str
    published: str          # quoted from the report
    here: str               # this run's figure
    key: str                # in `measured` (and in `holds` when measured)
    obtained: Literal["measured", "by construction"]
    spread: str = ""        # how much it moved within this run: the range of its paired ratios, or ± the noise


def blog_rows(measured: dict[str, Any], decode_tok_s: dict[str, float], prefill_tok_s: dict[str, float],
              device_kind: str) -> list[BlogRow]:
    """The table's rows; `device_kind` ("CPU", "GPU") names what measured the INT4 vs FP8 rows."""
    p, m = PUBLISHED, measured
    ratios, noise = m.get("paired_ratios", {}), m["run_to_run_noise"]

    def pairs(key: str) -> str:
        got = ratios.get(key)
        return f"{min(got):.2f}–{max(got):.2f}" if got else ""

    kv_noise = f"±{100 * noise['kv_throughput']:.0f}%" if "kv_throughput" in noise else ""
    rows = [
        ("FP8 KV", f"tokens that fit, FP8 ({FP8_KV_LAYOUT} layout) / BF16",
         f"{p['kv_capacity_ratio']:.2f}× (686k → 1.37M)", f"{m['kv_capacity_ratio']:.2f}×", "kv_capacity_ratio", ""),
        ("", "peak requests running, BF16 → FP8", f"{p['bf16_saturation']} → {p['fp8_concurrency']}",
         f"{m['bf16_saturation']} → {m['fp8_concurrency']}", "bf16_saturation", ""),
        ("", "peak throughput, FP8 / BF16", f"{p['kv_peak_throughput_ratio']:.2f}× (1558 → 2192)",
         f"{m['kv_peak_throughput_ratio']:.2f}×", "kv_peak_throughput_ratio", kv_noise),
        ("INT4 weights", f"decode tok/s at batch 1, INT4 vs FP8 (resident), on {device_kind}",
         f"{p['int4_decode_ratio']:.2f}× (60 → 92)",
         f"{m['int4_decode_ratio']:.2f}× ({decode_tok_s['fp8']:.0f} → {decode_tok_s['int4']:.0f})",
         "int4_decode_ratio", pairs("int4_decode_ratio")),
        ("", f"prefill tok/s, INT4 vs FP8 (resident), on {device_kind}",
         f"{p['int4_prefill_ratio']:.2f}× (10160 → 8660)",
         f"{m['int4_prefill_ratio']:.2f}× ({prefill_tok_s['fp8']:.0f} → {prefill_tok_s['int4']:.0f})",
         "int4_prefill_ratio", pairs("int4_prefill_ratio")),
        ("integrity", "the check's share of step time", "< 1%", f"{100 * m['integrity_share_of_step']:.2f}%",
         "integrity_share_of_step", ""),
        ("", "throughput cost, end to end", "0.38–0.79%", f"{100 * m['integrity_throughput_cost']:.2f}%",
         "integrity_throughput_cost", f"±{100 * noise['throughput']:.0f}%"),
        ("", "p95 TPOT cost, end to end", "0.42–0.80%", f"{100 * m['integrity_p95_cost']:.2f}%",
         "integrity_p95_cost", f"±{100 * noise['p95']:.0f}%"),
    ]
    accuracy = [("accuracy", f"FP8 KV ({FP8_KV_LAYOUT} layout) vs BF16 KV: Δ top-1, points", "MMLU +0.07 points",
                 "fp8_kv_top1_delta"),
                ("", "INT4 experts vs BF16: Δ top-1, points", "every score ±1 point", "int4_top1_delta")]
    rows += [(technique, figure, published, f"{100 * m[key]['value']:+.2f}", key,
              f"{100 * m[key]['low']:+.1f}…{100 * m[key]['high']:+.1f}")
             for technique, figure, published, key in accuracy if key in m]
    return [BlogRow(*row[:5], "by construction" if row[4] in BY_CONSTRUCTION else "measured", row[5])
            for row in rows]


def blog_table(rows: list[BlogRow], holds: dict[str, bool | None], device: str) -> Table:
    """Published (quoted) beside this run's figure (measured on `device`) and how much it moved within the run,
    and for each measured figure whether the published shape holds; a figure fixed by the set-up says "by
    construction" there instead."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
                  title=f"the published results at small scale · here: measured on {device}, except rows by "
                        f"construction")
    # fixed widths but the figure's, which takes what is left (26 of 120 columns): where a figure wraps does not
    # depend on this run's numbers
    for name, width in (("technique", 12), ("figure", None), ("published (quoted)", 20), ("here", 20),
                        ("spread", 9), ("shape holds", 15)):
        table.add_column(name, justify="right" if name in ("published (quoted)", "here", "spread") else "left",
                         no_wrap=name != "figure", width=width)
    for row in rows:
        verdict = ("by construction" if row.obtained == "by construction" else
                   {True: "yes", False: "no", None: "within noise"}[holds[row.key]])
        table.add_row(row.technique, row.figure, row.published, row.here, row.spread, verdict,
                      end_section=row.key in ("kv_peak_throughput_ratio", "int4_prefill_ratio",
                                              "integrity_p95_cost"))
    return table
