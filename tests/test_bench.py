"""The workbench: `nano bench` (load, compare, sweep, split, reproduce-blog, against a server), `nano
profile`, the chat polish, and every command's --help and bad flags. The commands that run a model run on the
tiny GLM-5 checkpoint (conftest.py's `tiny_glm5`: a step costs a seventh of the nano stand-in's, and it has
every part the stand-in has: MLA, the DSA indexer, a dense layer, routed and shared experts) at small sizes; the JSON
figures are checked against what the run must have done (the workload regenerated from its seed, the KV pool's
bytes worked out by hand from the checkpoint's dimensions, the wall time the test itself measured), not only for
being present. `nano bench --base-url` runs against nano's server in this process, and its figures are checked
against the offline bench's on the same workload."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
import typer
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from fixtures import TINY, TINY_INDEXER, assert_user_error, nano
from test_serve import serving
from nano.cli.loadgen import HttpTarget, Workload, summarize
from nano.cli.main import app
from nano.cli.profiler import component_times, profiler_setup
from nano.config import ModelConfig
from nano.presets import PRESETS

RAW = PRESETS["glm-5.2"].nano_config          # the stand-in's config.json, as published dimensions
VOCAB = TINY["vocab_size"]                     # the tiny checkpoint's


def kv_bytes_per_token(dims: dict, indexer_layers: int, element: int, scale: int = 0) -> int:
    """By hand: per layer a latent + rope key (+ its scale), and on the indexer layers an indexer key (+ scale)."""
    latent = dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
    return dims["num_hidden_layers"] * (latent * element + scale) + indexer_layers * (dims["index_head_dim"] * element
                                                                                      + scale)


# the tiny checkpoint: 3 layers, each computing its indexer's top-k (its config.json's indexer_types)
FP32, BF16, FP8 = (kv_bytes_per_token({**TINY, **TINY_INDEXER}, 3, element, scale) for element, scale in
                   ((4, 0), (2, 0), (1, 4)))
# a pool of 3,120 fp32 tokens, where the default budget (256 MiB) gives the tiny checkpoint 25,000 pages that the
# suite checks one by one after every step (conftest.py)
SMALL_POOL = ("--kv-budget", "2MiB")


def finite_numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in finite_numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in finite_numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def bench_json(tmp_path, model, *flags: str) -> dict:
    """Run `nano bench MODEL` with `flags`; its JSON report, with the wall time this test measured around it and
    what it printed (stdout, stderr)."""
    path = tmp_path / "bench.json"
    started = time.perf_counter()
    result = nano("bench", str(model), *flags, "--output", str(path))
    wall_s = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    assert any(word in result.stdout for word in ("completed", "shape holds", "req/s"))   # tables on stdout
    return {**json.loads(path.read_text()), "wall_s": wall_s, "stdout": result.stdout, "stderr": result.stderr}


def check_run(figures: dict, workload: Workload, concurrency: int, wall_s: float) -> None:
    assert figures["completed"] + figures["failed"] == len(workload.prompts) == figures["num_prompts"]
    assert figures["failed"] == 0 and figures["errors"] == {}
    assert 1 <= figures["peak_running"] <= concurrency
    assert figures["input_tokens"] == sum(map(len, workload.prompts))
    assert figures["output_tokens"] == sum(workload.output_lens)              # ignore_eos: every token is made
    assert all(math.isfinite(x) and x >= 0 for x in finite_numbers(figures))
    # the run took no longer than the whole command did, so its rates are at least tokens / the command's time
    assert 0 < figures["duration_s"] < wall_s
    assert figures["input_tok_s"] >= figures["input_tokens"] / wall_s
    assert figures["output_tok_s"] >= figures["output_tokens"] / wall_s
    for metric in ("ttft", "tpot", "itl", "e2e"):
        stats = figures["latency_ms"][metric]
        assert 0 < stats["median"] <= stats["p95"] <= stats["p99"], metric
    assert figures["latency_ms"]["ttft"]["mean"] <= figures["latency_ms"]["e2e"]["mean"]
    kv = figures["kv"]
    assert 0 < kv["peak_pages"] <= kv["pages"] and kv["capacity_tokens"] == kv["pages"] * kv["page_size"]
    assert figures["integrity"]["checked"] >= figures["steps"] > 0 and figures["integrity"]["mismatched"] == 0


def test_the_stand_ins_kv_bytes_per_token():
    """The figures the docs quote for glm-5.2-random (the commands here run on the tiny checkpoint): GLM-5's
    indexer keys on 5 of its 8 layers (0 and 1, then every other one: 3, 5, 7), and FP8's per-token fp32 scales."""
    from nano.llm import resolve_config

    stand_in = resolve_config("glm-5.2-random")[1]
    for kv_dtype, element, scale, by_hand in (("fp32", 4, 0, 6400), ("bf16", 2, 0, 3200), ("fp8", 1, 4, 1652)):
        assert stand_in.kv_bytes_per_token(kv_dtype) == kv_bytes_per_token(RAW, 5, element, scale) == by_hand


def test_bench_json_figures_are_consistent(tmp_path, tiny_glm5):
    report = bench_json(tmp_path, tiny_glm5, "--concurrency", "4", "--num-prompts", "10", "--input-len", "8-40",
                        "--output-len", "2-6", "--page-size", "16", "--seed", "3")
    workload = Workload.random(10, (8, 40), (2, 6), VOCAB, 3)
    check_run(report["runs"][0]["results"][0], workload, 4, report["wall_s"])
    assert len(set(map(len, workload.prompts))) > 1 and len(set(workload.output_lens)) > 1   # really ranges
    # the table's title is a line of its own, whole, however narrow the table under it
    assert f"{tiny_glm5} · 10 prompts · input 8-40 · output 2-6 · seed 3 · concurrency 4" in \
        report["stdout"].splitlines()
    assert report["config"]["num_prompts"] == 10 and report["runs"][0]["engine"]["page_size"] == 16
    environment = report["environment"]
    assert environment["torch"] and environment["triton"] and environment["cpu_count"] >= 1
    kv = report["runs"][0]["results"][0]["kv"]
    assert FP32 == 672                                     # 3 × 40 × 4 + 3 × 16 × 4
    assert kv["pool_bytes"] == kv["pages"] * 16 * FP32 and kv["pool_bytes"] <= 256 * 2**20   # the default budget
    # the prefix cache is on by default, but the warm-up ran prompts of its own: every measured prompt token is
    # computed, none comes from the cache
    cache = report["runs"][0]["results"][0]["prefix_cache"]
    assert cache["enabled"] and cache["cached_tokens"] == 0 and cache["hit_rate"] == 0
    assert cache["prefill_tokens"] == cache["lookup_tokens"] == sum(map(len, workload.prompts))


def test_default_num_prompts_is_five_times_concurrency(tmp_path, tiny_glm5):
    report = bench_json(tmp_path, tiny_glm5, "--concurrency", "2", "--input-len", "8", "--output-len", "2",
                        "--warmup", "0", *SMALL_POOL)
    assert report["runs"][0]["results"][0]["num_prompts"] == 10


def test_compare_kv_dtype_fp8_runs_nearly_twice_the_requests_under_one_budget(tmp_path, tiny_glm5):
    # 40 + 8 tokens fill three 16-token pages exactly; the budget holds 8 such requests in BF16
    budget = 8 * 3 * 16 * BF16
    report = bench_json(tmp_path, tiny_glm5, "--concurrency", "16", "--num-prompts", "40", "--input-len", "40",
                        "--output-len", "8", "--page-size", "16", "--kv-budget", str(budget),
                        "--compare", "kv-dtype=bf16,fp8")
    bf16, fp8 = (run["results"][0] for run in report["runs"])
    workload = Workload.random(40, (40, 40), (8, 8), VOCAB, 0)
    for figures in (bf16, fp8):
        check_run(figures, workload, 16, report["wall_s"])
    assert [run["engine"]["kv_dtype"] for run in report["runs"]] == ["bf16", "fp8"]
    fp8_pages = budget // (16 * FP8)                                        # 129,024 // (16 × 192) = 42
    assert (bf16["kv"]["pages"], fp8["kv"]["pages"]) == (24, fp8_pages)
    assert bf16["peak_running"] == 8 and bf16["kv"]["peak_use"] == 1.0      # BF16 is full at 8
    assert fp8["peak_running"] == fp8_pages // 3 == 14                      # FP8: every whole request that fits


def test_compare_integrity_and_sweep(tmp_path, tiny_glm5):
    report = bench_json(tmp_path, tiny_glm5, "--concurrency", "4", "--num-prompts", "6", "--input-len", "16",
                        "--output-len", "3", "--compare", "integrity=on,off", *SMALL_POOL)
    on, off = (run["results"][0] for run in report["runs"])
    assert on["integrity"]["integrity"] and on["integrity"]["checked"] > 0
    assert not off["integrity"]["integrity"] and off["integrity"]["checked"] == 0
    report = bench_json(tmp_path, tiny_glm5, "--num-prompts", "6", "--input-len", "24", "--output-len", "3",
                        "--page-size", "16", "--sweep-concurrency", "1,3", *SMALL_POOL)
    results = report["runs"][0]["results"]
    assert report["mode"] == "sweep" and [r["concurrency"] for r in results] == [1, 3]
    assert results[0]["peak_running"] == 1 and results[1]["peak_running"] <= 3
    workload = Workload.random(6, (24, 24), (3, 3), VOCAB, 0)
    for figures, level in zip(results, (1, 3)):
        check_run(figures, workload, level, report["wall_s"])
        # one engine measures both levels (cache on), but no level runs prompts an earlier one or a warm-up ran
        # (24 tokens: a page of 16 would be taken from the cache)
        assert figures["prefix_cache"]["cached_tokens"] == 0


def test_bench_disagg_reports_the_split_beside_one_process(tmp_path, tiny_glm5):
    report = bench_json(tmp_path, tiny_glm5, "--disagg", "--concurrency", "3", "--num-prompts", "5", "--input-len",
                        "24", "--output-len", "4", "--page-size", "16", "--warmup", "1", *SMALL_POOL)
    split, single = (run["results"][0] for run in report["runs"])
    assert [run["name"] for run in report["runs"]] == ["split", "single process"]
    workload = Workload.random(5, (24, 24), (4, 4), VOCAB, 0)
    check_run(split, workload, 3, report["wall_s"])
    check_run(single, workload, 3, report["wall_s"])
    moved = split["split"]
    assert moved["transfers"] == 5 and len(set(moved["pids"].values())) == 2
    assert moved["bytes"] == 5 * 24 * BF16                                  # prefill pool: bf16 KV
    assert moved["gb_s"] > 0 and 0 < moved["share_of_plain_copy"] < 1.5
    assert split["kv"]["dtype"] == "fp8" and single["kv"]["dtype"] == "fp8"       # decode side's KV
    assert "split" not in single


def test_bench_shared_prefix_compare_prefix_cache(tmp_path, tiny_glm5):
    prompts, prefix, own, page = 6, 40, 8, 16
    report = bench_json(tmp_path, tiny_glm5, "--concurrency", "3", "--num-prompts", str(prompts), "--input-len",
                        str(own), "--output-len", "2", "--page-size", str(page), "--shared-prefix", str(prefix),
                        "--compare", "prefix-cache=on,off", *SMALL_POOL)
    on, off = (run["results"][0] for run in report["runs"])
    assert [run["engine"]["prefix_cache"] for run in report["runs"]] == [True, False]
    prompt_tokens = prompts * (prefix + own)
    for figures in (on, off):
        assert figures["completed"] == prompts and figures["failed"] == 0
        assert figures["input_tokens"] == prompt_tokens
    # off: every prompt token is computed, nothing is looked up
    assert off["prefix_cache"] == {"enabled": False, "cached_tokens": 0, "lookup_tokens": 0, "hit_rate": None,
                                   "prefill_tokens": prompt_tokens}
    # on: the warm-up's prompts share the prefix, so when measuring starts its whole pages are cached (40 tokens:
    # 2 pages of 16; the third page holds the prompt's own tokens too), and every prompt takes those from the cache
    cached = prompts * (prefix // page) * page                                   # 6 × 32
    assert on["prefix_cache"] == {"enabled": True, "cached_tokens": cached, "lookup_tokens": prompt_tokens,
                                  "hit_rate": pytest.approx(32 / 48), "prefill_tokens": prompt_tokens - cached}
    assert off["prefix_cache"]["prefill_tokens"] - on["prefix_cache"]["prefill_tokens"] == 192


def test_bench_multi_turn_conversations_reuse_their_history(tmp_path, tiny_glm5):
    # sizes chosen so that a turn's prompt fills whole 16-token pages: prefix 26 + 6 = 32, and each later turn
    # adds a 10-token reply and 6 new tokens = 16
    conversations, turns, prefix, own, reply, page = 3, 3, 26, 6, 10, 16
    report = bench_json(tmp_path, tiny_glm5, "--concurrency", "2", "--num-prompts", str(conversations),
                        "--multi-turn", str(turns), "--shared-prefix", str(prefix), "--input-len", str(own),
                        "--output-len", str(reply), "--page-size", str(page), "--warmup", "1", *SMALL_POOL)
    figures = report["runs"][0]["results"][0]
    assert figures["num_prompts"] == figures["completed"] == conversations * turns and figures["failed"] == 0
    assert 1 <= figures["peak_running"] <= 2                   # at most 2 conversations, one turn each, at once
    prompt_lens = [prefix + k * own + (k - 1) * reply for k in range(1, turns + 1)]       # 32, 48, 64
    assert figures["input_tokens"] == conversations * sum(prompt_lens)
    assert figures["output_tokens"] == conversations * turns * reply
    # turn 1 takes the prefix's whole page (the warm-up cached it); turn k + 1 takes turn k's whole prompt (whole
    # pages here), and no more: its first 16 new tokens (the reply, then its own) end in a page not full before
    reused = [(prefix // page) * page, *prompt_lens[:-1]]                               # 16, 32, 48
    cache = figures["prefix_cache"]
    assert cache["cached_tokens"] == conversations * sum(reused)
    assert cache["lookup_tokens"] == figures["input_tokens"]
    assert cache["prefill_tokens"] == figures["input_tokens"] - cache["cached_tokens"] == conversations * turns * 16
    assert len(figures["ttft_ms_by_turn"]) == turns and all(ms > 0 for ms in figures["ttft_ms_by_turn"])
    assert report["config"]["multi_turn"] == turns and report["config"]["shared_prefix"] == prefix
    assert "plan: 1 phase: weights auto, KV auto · concurrency 2 (9 requests)." in report["stderr"]   # 3 × 3 turns


def test_reproduce_blog(tmp_path, monkeypatch, tiny_glm5):
    # every experiment on the tiny checkpoint, and smaller: a budget of 8 BF16 requests with 16 in flight (16
    # requests still fill the BF16 budget twice and reach FP8's limit), 5 weight pairs (the fewest with which the
    # sign test can decide) of 8 decoded tokens and 64-token prefills, and 4 accuracy windows of 128 tokens; the
    # accuracy rows measure the checkpoint itself. --kv-budget sizes the pools of the engines that are not the KV
    # experiment's (which sizes its own): the suite checks every page of a pool after every step (conftest.py)
    from nano.cli import blog
    monkeypatch.setattr(blog, "KV_REQUESTS_BF16", 8)
    monkeypatch.setattr(blog, "LOAD", (16, 40, 8))
    monkeypatch.setattr(blog, "WEIGHT_PAIRS", 5)
    monkeypatch.setattr(blog, "DECODE", (16, 8))
    monkeypatch.setattr(blog, "PREFILL", (64, 1))
    monkeypatch.setattr(blog, "ACCURACY_SETTINGS", dataclasses.replace(
        blog.ACCURACY_SETTINGS, contexts=(128,), max_tokens=512, prompts=2, prompt_tokens=16, gen_tokens=4))
    report = bench_json(tmp_path, tiny_glm5, "--reproduce-blog", *SMALL_POOL, "--plot", str(tmp_path / "blog.svg"))
    assert str(tiny_glm5) in report["label"]                                       # the speed rows' model
    measured, holds, obtained = report["measured"], report["holds"], report["obtained"]
    assert set(measured) >= set(report["published"])
    # rows fixed by the set-up say so and get no verdict; every other row is measured and gets one
    by_construction = {"kv_capacity_ratio", "bf16_saturation"}
    assert {key for key, how in obtained.items() if how == "by construction"} == by_construction
    assert set(holds) == {key for key, how in obtained.items() if how == "measured"}
    assert report["measured_on"]
    # the KV pool's arithmetic, by hand: a budget of 8 BF16 requests of 3 pages, and the pages it holds in FP8's
    # tensor layout (the report's: 1 byte a latent and rope value, no scale; the indexer key keeps its fp32 scale):
    # 3 × (32 + 8) + 3 × (16 + 4) = 180 B per token, against 3 × 80 + 3 × 32 = 336 in BF16: 44 pages of 16 tokens
    fp8_tensor = 3 * (32 + 8) + 3 * (16 + 4)
    fp8_pages = 8 * 3 * 16 * BF16 // (16 * fp8_tensor)
    assert (BF16, fp8_tensor, fp8_pages) == (336, 180, 44)
    assert measured["kv_capacity_ratio"] == pytest.approx(fp8_pages / (8 * 3), abs=1e-9)
    assert measured["bf16_saturation"] == 8 and measured["fp8_concurrency"] == fp8_pages // 3 == 14
    assert report["fp8_kv_layout"] == "tensor"
    assert {run["kv"]["layout"] for name, run in report["runs"]["kv"].items() if name.startswith("fp8")} == {"tensor"}
    assert {run["kv"]["layout"] for run in report["runs"]["integrity"]["on"]} == {"tensor"}
    assert 0 < measured["integrity_share_of_step"] < 0.25     # measured (its cost: benchmarks/integrity.py)
    for run in report["runs"]["kv"].values():
        assert run["completed"] == 16 and run["failed"] == 0
    for figures in report["runs"]["weights"].values():        # one sample of each figure per pair
        assert [len(samples) for samples in figures.values()] == [5, 5]
    accuracy = report["runs"]["accuracy"]
    assert str(tiny_glm5) in accuracy["model"]
    pools = {run["name"]: run["setup"]["kv_dtype"] for run in accuracy["report"]["configurations"]}
    assert pools == {"fp8 kv": "fp8:tensor", "int4 weights": "bf16"}          # each against the BF16 reference
    assert {"fp8_kv_top1_delta", "int4_top1_delta"} <= set(holds)
    for key in ("fp8_kv_top1_delta", "int4_top1_delta"):
        assert measured[key]["low"] <= measured[key]["value"] <= measured[key]["high"]
    # the chart (tests/test_plot.py reads one closely): this run's figures, each with how it was obtained
    chart = (tmp_path / "blog.svg").read_text()
    assert f"{measured['kv_capacity_ratio']:.2f}× by construction" in chart and "8 by construction" in chart
    assert f"{measured['fp8_concurrency']} measured" in chart
    # the plan, before the work: each run in order; the accuracy phase scores 4 windows of 128 tokens and 2
    # prompts of 16 tokens + 4 generated, in each of 3 configurations
    runs = [f"KV {kv}, run {run} of 2 (16 requests)" for kv, run in (("bf16", 1), ("fp8", 1), ("fp8", 2),
                                                                      ("bf16", 2))]
    runs += ["INT4 vs FP8 weights (5 pairs)"]
    runs += [f"integrity {state}, run {run} of 4 (16 requests)" for run, state in enumerate(("on", "off", "off",
                                                                                            "on"), 1)]
    runs += [f"accuracy: nano eval ({3 * (4 * 128 + 2 * (16 + 4)):,} tokens)"]
    assert f"plan: 10 phases: {'; '.join(runs)}." in report["stderr"]


@pytest.mark.parametrize("low, high, holds", [(-0.004, 0.003, True), (-0.03, -0.012, False), (0.011, 0.02, False),
                                              (-0.015, 0.002, None)])
def test_accuracy_rows_hold_when_the_interval_lies_within_a_point(low, high, holds):
    from nano.cli.blog import within_a_point

    assert within_a_point({"value": (low + high) / 2, "low": low, "high": high}) is holds


def test_accuracy_rows_measure_the_trained_stand_in():
    from nano.cli.blog import accuracy_model

    assert accuracy_model("glm-5.2-random") == "glm-5.2" and accuracy_model("kimi-k2.6") == "kimi-k2.6"
    assert accuracy_model("moonlight-16b") is None and accuracy_model("/some/checkpoint") == "/some/checkpoint"


def test_reproduce_blog_table_labels_how_each_figure_was_obtained():
    from rich.console import Console

    from nano.cli.blog import blog_rows, blog_table

    measured = {"kv_capacity_ratio": 1.93, "bf16_saturation": 32, "fp8_concurrency": 61,
                "kv_peak_throughput_ratio": 1.1, "int4_decode_ratio": 1.5, "int4_prefill_ratio": 0.9,
                "integrity_throughput_cost": 0.001, "integrity_share_of_step": 0.003, "integrity_p95_cost": 0.002,
                "run_to_run_noise": {"throughput": 0.05, "p95": 0.05}}
    holds = {"kv_peak_throughput_ratio": True, "int4_decode_ratio": True, "int4_prefill_ratio": False,
             "integrity_share_of_step": True, "integrity_throughput_cost": None, "integrity_p95_cost": None}
    rows = blog_rows(measured, {"fp8": 40.0, "int4": 60.0}, {"fp8": 1000.0, "int4": 900.0}, "CPU")
    console = Console(width=250)
    with console.capture() as captured:
        console.print(blog_table(rows, holds, "test CPU"))
    text = captured.get()
    assert "measured on test CPU" in text and "published (quoted)" in text
    capacity = next(line for line in text.splitlines() if "tokens that fit" in line)
    saturation = next(line for line in text.splitlines() if "peak requests running" in line)
    for line in (capacity, saturation):
        assert line.rstrip().endswith("by construction") and not {"yes", "no"} & set(line.split())   # no verdict
    decode = next(line for line in text.splitlines() if "decode tok/s" in line)
    prefill = next(line for line in text.splitlines() if "prefill tok/s" in line)
    assert "INT4 vs FP8 (resident), on CPU" in decode and decode.split()[-1] == "yes"
    assert "INT4 vs FP8 (resident), on CPU" in prefill and prefill.split()[-1] == "no"


# ---- the progress of a long command (cli/progress.py) -------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def plain_console():
    """A console that is not a terminal (piped), and what it was given."""
    import io

    from rich.console import Console

    stream = io.StringIO()
    return Console(file=stream, width=200, force_terminal=False), stream


def test_progress_announces_its_plan_then_a_line_each_interval_and_phase():
    from nano.cli.progress import Phase, Progress

    console, stream = plain_console()
    clock = FakeClock()
    # the second phase's units each weigh 4 of the first's: 4 × 10 + 2 × 40 = 120 in all
    with Progress([Phase("load", 4, work=10), Phase("pairs of runs", 2, "pairs", work=40)], clock=clock,
                  console=console) as progress:
        for now in (10, 30, 40):
            clock.now = now
            progress.tick()                       # a line only at 30: 30 s after the plan
        progress.advance(2)                       # 20 of 120 done in 40 s
        clock.now = 60
        progress.tick()                           # 60 s for 20: 300 s for the 100 left
        clock.now = 75
        progress.advance(2)                       # a phase starts: a line at once (75 s for 40: 150 s for 80)
        clock.now = 90
        progress.tick()                           # 15 s after the last line: none
    assert stream.getvalue().splitlines() == [
        "plan: 2 phases: load (4 requests); pairs of runs (2 pairs). The ETA is measured as the run goes.",
        "phase 1/2 load: 0/4 requests · 30 s so far · no ETA before the first unit",
        "phase 1/2 load: 2/4 requests · 1 min 00 s so far · about 5 min 00 s left",
        "phase 2/2 pairs of runs: 0/2 pairs · 1 min 15 s so far · about 2 min 30 s left"]


def test_a_plan_measured_on_idle_cores_announces_that_time_only_when_every_phase_was():
    from nano.cli.progress import Phase, Progress

    for phases, about in (([Phase("a", 4, idle_s=50.0), Phase("b", 2, "pairs", idle_s=75.0)],
                           ", about 2 min 05 s on 2 idle cores (measured there; longer on a busy machine)"),
                          ([Phase("a", 4, idle_s=50.0), Phase("b", 2, "pairs")], "")):
        console, stream = plain_console()
        with Progress(phases, console=console, interval=0):
            pass
        assert stream.getvalue().splitlines() == [
            f"plan: 2 phases{about}: a (4 requests); b (2 pairs). The ETA is measured as the run goes."]


def test_progress_prints_a_line_while_one_unit_runs_long():
    """Not a terminal: the timer thread prints a line while no unit finishes (the caller is blocked); it reads
    the progress object's counters only. The interval is short here; the wait below is a hang guard."""
    import threading

    from nano.cli.progress import Phase, Progress

    console, stream = plain_console()
    printed = threading.Event()
    write = stream.write
    stream.write = lambda text: (printed.set() if "phase 1/1" in text else None, write(text))[1]
    with Progress([Phase("one long request", 1)], interval=0.05, console=console):
        assert printed.wait(timeout=60), "no progress line while the unit ran"
    assert "phase 1/1 one long request: 0/1 requests" in stream.getvalue()


def test_progress_on_a_terminal_shows_the_phase_and_the_eta():
    import io

    from rich.console import Console

    from nano.cli.progress import Phase, Progress

    stream, clock = io.StringIO(), FakeClock()
    console = Console(file=stream, width=160, force_terminal=True)
    with Progress([Phase("KV bf16", 4), Phase("KV fp8", 4)], clock=clock, console=console) as progress:
        clock.now = 8
        progress.advance(5)                      # 5 of 8 in 8 s: 3 left, about 5 s (shown as it stops)
    shown = stream.getvalue()
    assert shown.startswith("plan: 2 phases: KV bf16 (4 requests); KV fp8 (4 requests).")
    assert "phase 2/2 KV fp8" in shown and "1/4 requests · 8 s so far · about 5 s left" in shown


@pytest.mark.parametrize("flags,fragment,code", [
    (["--input-len", "0"], "--input-len", 2),
    (["--input-len", "abc"], "--input-len", 2),
    (["--output-len", "9-3"], "--output-len", 2),
    (["--concurrency", "0"], "--concurrency", 2),
    (["--compare", "color=red,blue"], "--compare", 2),
    (["--compare", "kv-dtype=bf16"], "at least two", 2),
    (["--compare", "kv-dtype=bf16,fp4"], "kv-dtype= takes", 2),
    (["--compare", "kv-dtype=bf16,bf16"], "listed twice", 2),
    (["--compare", "kv-dtype=bf16,fp8", "--kv-dtype", "fp8"], "--kv-dtype does nothing with --compare", 2),
    (["--compare", "integrity=yes,no"], "on,off", 2),
    (["--compare", "prefix-cache=yes,no"], "on,off", 2),
    (["--shared-prefix", "0"], "--shared-prefix", 2),
    (["--multi-turn", "0"], "--multi-turn", 2),
    (["--reproduce-blog", "--shared-prefix", "8"], "--shared-prefix does nothing", 2),
    (["--reproduce-blog", "--multi-turn", "2"], "--multi-turn does nothing", 2),
    (["--reproduce-blog", "--kv-layout", "tile"], "--kv-layout does nothing with --reproduce-blog", 2),
    (["--reproduce-blog", "--prefix-cache"], "--prefix-cache does nothing", 2),
    (["--sweep-concurrency", "1,x"], "--sweep-concurrency", 2),
    (["--sweep-concurrency", "0"], "--sweep-concurrency", 2),
    (["--compare", "kv-dtype=bf16,fp8", "--sweep-concurrency", "1,2", "--concurrency", "4"],
     "--concurrency does nothing with --sweep-concurrency", 2),
    (["--disagg", "--reproduce-blog"], "cannot be combined", 2),
    (["--transport", "rdma", "--disagg"], "--transport", 2),
    (["--kv-budget", "lots"], "--kv-budget", 2),
    (["--input-len", "4000", "--output-len", "200"], "context", 1),
    (["--input-len", "4000", "--output-len", "96", "--shared-prefix", "1"], "context", 1),     # 4,097 > 4,096
    (["--input-len", "1000", "--output-len", "100", "--multi-turn", "4"], "context", 1),      # last turn: 4,400
    (["--request-rate", "0"], "--request-rate", 2),
    (["--reproduce-blog", "--request-rate", "2"], "--request-rate does nothing", 2),
    (["--endpoint", "chat"], "--endpoint needs --base-url", 2),
    (["--api-key", "sekret"], "--api-key needs --base-url", 2),
    (["--base-url", "127.0.0.1:8000"], "--base-url", 2),
    # the server's engine is configured by nano serve: every engine flag and engine mode is refused, before any
    # connection is tried (nothing listens on port 9)
    (["--base-url", "http://127.0.0.1:9", "--kv-dtype", "fp8"], "--kv-dtype does nothing with --base-url", 2),
    (["--base-url", "http://127.0.0.1:9", "--disagg"], "--disagg does nothing with --base-url", 2),
    (["--base-url", "http://127.0.0.1:9", "--compare", "kv-dtype=bf16,fp8"], "--compare does nothing", 2),
    (["--base-url", "http://127.0.0.1:9", "--sweep-concurrency", "1,2"], "--sweep-concurrency does nothing", 2),
    (["--base-url", "http://127.0.0.1:9", "--reproduce-blog"], "--reproduce-blog does nothing", 2),
    (["--base-url", "http://127.0.0.1:9", "--input-len", "4000", "--output-len", "200"], "context", 1),
])
def test_bench_bad_flags(flags, fragment, code):
    assert_user_error(nano("bench", "glm-5.2-random", *flags), fragment, exit_code=code)


# ---- --compare: one parser, nano bench's keys and nano eval's ------------------------------------------------------
BENCH_KEYS, EVAL_KEYS = ("kv-dtype", "weights", "integrity", "prefix-cache"), ("kv-dtype", "weights", "policy")


@pytest.mark.parametrize("keys,text,typed,settings,fragment", [
    (BENCH_KEYS, "policy=bf16/int4,fp8/int4", (), {}, "KEY one of kv-dtype, weights, integrity, prefix-cache"),
    (EVAL_KEYS, "integrity=on,off", (), {}, "KEY one of kv-dtype, weights, policy"),
    (EVAL_KEYS, "kv-dtype=bf16,fp8", (), {"kv_budget": "lots"}, "--kv-budget"),      # every configuration checked
    # once nano eval's rules only
    (BENCH_KEYS, "kv-dtype=bf16,bf16", (), {}, "a value is empty or listed twice"),
    (BENCH_KEYS, "integrity=on,,off", (), {}, "a value is empty or listed twice"),
    (BENCH_KEYS, "weights=bf16,int5", (), {}, "weights= takes weight formats"),
    (BENCH_KEYS, "kv-dtype=fp8,fp4", (), {}, "kv-dtype= takes auto, fp32, bf16, fp8 or fp8:LAYOUT"),
    (BENCH_KEYS, "kv-dtype=bf16,fp8", ("kv_dtype",), {"kv_dtype": "fp8"}, "--kv-dtype does nothing with --compare"),
    (BENCH_KEYS, "weights=bf16,fp8", ("decode_weights",), {"decode_weights": "int4"}, "--decode-weights does nothing"),
    (BENCH_KEYS, "integrity=on,off", ("integrity",), {"integrity": False}, "--no-integrity does nothing with"),
    (BENCH_KEYS, "prefix-cache=on,off", ("prefix_cache",), {}, "--prefix-cache does nothing with"),
    (BENCH_KEYS, "weights=bf16,fp8", ("int4_all", "weights"), {"int4_all": True, "weights": "int4"},
     "--weights does nothing"),
    (BENCH_KEYS, "weights=bf16,fp8", ("int4_all",), {"int4_all": True, "weights": "int4"}, "no value of --compare"),
    # once nano bench's rules only
    (EVAL_KEYS, "kv-dtype=fp8", (), {}, "at least two values"),     # (nano eval asks for one: least=1, below)
])
def test_compare_refuses(keys, text, typed, settings, fragment):
    from nano.cli.options import EngineOptions, parse_compare
    from nano.engine import EngineConfig
    from nano.errors import UsageError

    engine = EngineOptions(EngineConfig(**settings), typed=frozenset(typed))
    with pytest.raises(UsageError) as refused:
        parse_compare(text, engine, keys)
    assert fragment in str(refused.value)


def test_compare_makes_one_checked_configuration_per_value():
    """Each value is a configuration named KEY=VALUE: weights and policy set the two phases' formats (a --weights
    checkpoint directory stays), --int4-all goes to the values with int4 weights; nano eval takes a single value."""
    from nano.cli.options import EngineOptions, parse_compare
    from nano.engine import EngineConfig

    engine = EngineOptions(EngineConfig(weights="int4", int4_all=True), typed=frozenset({"int4_all"}))
    variants = parse_compare("policy=bf16/int4,fp8/fp8", engine, EVAL_KEYS)
    assert [name for name, _ in variants] == ["policy=bf16/int4", "policy=fp8/fp8"]
    assert [v.config.phase_weights for _, v in variants] == [("bf16", "int4"), ("fp8", "fp8")]
    assert [v.config.int4_all for _, v in variants] == [True, False]
    switched = parse_compare("prefix-cache=off,on", EngineOptions(), BENCH_KEYS)
    assert [v.config.prefix_cache for _, v in switched] == [False, True]
    assert [name for name, _ in parse_compare("kv-dtype=fp8", EngineOptions(), EVAL_KEYS, least=1)] == ["kv-dtype=fp8"]


def test_bench_output_to_an_unwritable_place_is_refused_before_the_run(tmp_path):
    result = nano("bench", "glm-5.2-random", "--concurrency", "1", "--num-prompts", "1", "--input-len", "4",
                  "--output-len", "2", "--warmup", "0", "--output", str(tmp_path / "missing" / "out.json"))
    assert_user_error(result, "--output")
    assert result.stderr.count("\n") == 1, "the path must be checked before the model loads"


# ---- nano profile ----------------------------------------------------------------------------------------------
def test_profile_reports_components_memory_and_bandwidth(tmp_path, tiny_glm5):
    trace = tmp_path / "trace.json"
    config = ModelConfig.from_hf(json.loads((tiny_glm5 / "config.json").read_text()))
    result = nano("profile", str(tiny_glm5), "--batch", "2", "--input-len", "32", "--steps", "2", "--json",
                  "--trace", str(trace))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for phase in ("prefill", "decode"):
        times = report[phase]["ms"]
        assert {"attention", "indexer", "router", "routed experts", "integrity check", "sampler",
                "schedule"} <= set(times)
        assert all(math.isfinite(v) and v >= 0 for v in times.values())
        assert times["attention"] > 0 and times["routed experts"] > 0 and times["indexer"] > 0
    assert report["decode"]["rows_per_step"] == 2                    # the whole batch, in every profiled step
    assert report["times"] == "CPU time"
    memory = report["memory_bytes"]
    weights = sum(memory["weights"].values())
    assert weights == pytest.approx(4 * config.num_parameters(), rel=0.02)          # fp32 on CPU
    assert memory["kv_pool"] > 0 and 0 < memory["activations_peak_prefill"] < weights
    assert report["copy_gb_s"] > 0
    for phase, rows in (("prefill", 32), ("decode", 2)):
        roof = report[phase]["roofline"]
        assert 0 < roof["bytes_read"] <= weights + memory["kv_pool"]
        assert 0 < roof["share_of_copy"] < 2 and 0 < roof["share_of_gemm"] < 2 and roof["dense_gemm_shape"][0] == rows
        # the counted matmul FLOPs against the configuration's arithmetic: 2 per weight a token multiplies (every
        # Linear but the routed experts, which count K times, and the indexer's query head, which this short
        # context skips), plus attention, at most: per layer and head, 2 per latent + rope value of each position
        # read for the scores and 2 per latent value for the output, over the <= 41 cached tokens rounded up to
        # the 64-token page the engine reads (at this width that is up to a third of the total)
        linear = per_token_weights(config)
        attention = (config.num_hidden_layers * config.num_attention_heads * 2
                     * (2 * config.kv_lora_rank + config.qk_rope_head_dim) * 64)
        assert 2 * rows * linear <= roof["flops"] <= 1.01 * rows * (2 * linear + attention), (roof["flops"], linear)
    assert report["decode"]["roofline"]["step_ms"] == report["decode"]["step_ms_unprofiled"]
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"attention", "router", "forward", "integrity check"} <= names


def test_the_profilers_own_lines_do_not_reach_stderr(capfd):
    """torch's profiler (kineto) writes `USDT: ... profiler_start` lines to file descriptor 2, past sys.stderr, at
    every start and stop; nano profile starts and stops it inside `quiet_stderr`, which drops them and nothing
    written after it. `capfd` reads file descriptor 2 itself."""
    from torch.profiler import profile

    from nano.cli.profiler import quiet_stderr

    with quiet_stderr():
        with profile():
            torch.ones(2) + 1
        os.write(2, b"inside\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def per_token_weights(cfg: ModelConfig) -> int:
    """The weights one token multiplies in a forward pass, from the model's module shapes."""
    from nano.model import Transformer

    model = Transformer(cfg, materialize=False)
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("indexer.wq_b"):
            count = module.in_features * module.out_features
            total += count * cfg.num_experts_per_tok // cfg.n_routed_experts if ".experts." in name else count
    return total


def test_profile_with_int4_labels_the_dequant_matmuls(tiny_glm5):
    # the tiny checkpoint has every labelled part (attention, the indexer, a dense MLP, routed and shared experts)
    result = nano("profile", str(tiny_glm5), "--batch", "1", "--input-len", "16", "--steps", "1", "--weights", "int4",
                  "--dtype", "bfloat16", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["decode"]["ms"]["int4 dequant-matmul"] > 0
    result = nano("profile", str(tiny_glm5), "--batch", "1", "--input-len", "16", "--steps", "1", "--weights", "int4",
                  "--int4-all", "--dtype", "bfloat16", "--json")
    times = json.loads(result.stdout)["decode"]["ms"]           # attention's INT4 projections counted once
    assert times["int4 dequant-matmul"] > 0 and times["attention"] > 0 and times["routed experts"] > 0


def test_profile_reads_kernel_time_on_cuda_and_cpu_time_on_cpu():
    assert profiler_setup(torch.device("cpu")) == ([ProfilerActivity.CPU], "cpu_time_total")
    assert profiler_setup(torch.device("cuda", 0)) == ([ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                                       "device_time_total")

    def event(key: str, device: DeviceType, cpu_us: float, device_us: float) -> SimpleNamespace:
        return SimpleNamespace(key=key, device_type=device, cpu_time_total=cpu_us, device_time_total=device_us)

    # on CUDA a label appears twice: the CPU-side range (its device time: the kernels launched inside it) and a
    # GPU-side copy spanning idle time as well, which must not be read
    events = [event("forward", DeviceType.CPU, 900, 5000), event("attention", DeviceType.CPU, 300, 2000),
              event("attention", DeviceType.CUDA, 0, 9999), event("indexer", DeviceType.CPU, 100, 500),
              event("moe", DeviceType.CPU, 400, 2500), event("router", DeviceType.CPU, 50, 100)]
    profiled = SimpleNamespace(key_averages=lambda: events)
    kernel = component_times(profiled, steps=2, time_total="device_time_total")
    assert kernel["attention"] == pytest.approx((2000 - 500) / 1e3 / 2)       # ms per step, less the indexer
    assert kernel["routed experts"] == pytest.approx((2500 - 100) / 1e3 / 2)
    assert kernel["other (norms, embeddings, lm_head)"] == pytest.approx((5000 - 2000 - 2500) / 1e3 / 2)
    host = component_times(profiled, steps=2)
    assert host["attention"] == pytest.approx((300 - 100) / 1e3 / 2)


@pytest.mark.parametrize("flags,fragment,code", [
    (["--batch", "0"], "--batch", 2),
    (["--input-len", "100000"], "--input-len", 1),     # a limit of the model that was loaded
    (["--kv-dtype", "fp4"], "--kv-dtype", 2),
])
def test_profile_bad_flags(flags, fragment, code, tiny_glm5):
    assert_user_error(nano("profile", str(tiny_glm5), *flags), fragment, exit_code=code)


# ---- every command's --help ------------------------------------------------------------------------------------
def test_every_option_of_every_command_is_documented():
    group = typer.main.get_group(app)
    for name, command in group.commands.items():
        assert command.help, name
        for param in command.params:
            if getattr(param, "hidden", False):   # MODEL and the fault choice are described in the command's text
                assert (param.metavar or param.opts[0]) in command.help, f"nano {name}: {param.name} undescribed"
            elif param.name != "click_context":
                assert getattr(param, "help", None), f"nano {name}: {param.name} has no help"
        result = nano(name, "--help")
        assert result.exit_code == 0 and "Usage:" in result.stdout and "--help" in result.stdout


# ---- nano chat polish -------------------------------------------------------------------------------------------
def test_chat_set_system_and_multiline_input():
    script = "\n".join(["/set temperature 0", "/set top_k x", "/set", "/system Answer briefly.", "/system",
                        '"""', "first line", "second line", '"""', "/stats", "/exit"]) + "\n"
    result = nano("chat", "glm-5.2-random", "--max-tokens", "3", stdin=script)
    assert result.exit_code == 0, result.output
    assert "temperature = 0.0" in result.stdout and "temperature 0.0" in result.stdout
    assert "error: /set top_k: 'x' is not an integer" in result.stderr
    assert "system: Answer briefly." in result.stdout
    assert result.stderr.count("generation:") == 1                 # the two lines were one message
    assert "TTFT" in result.stderr and "KV held:    1 page = " in result.stdout


# ---- nano bench --base-url: the same workloads against a server -------------------------------------------------
HTTP_WORKLOAD = ("--num-prompts", "8", "--concurrency", "4", "--input-len", "16", "--output-len", "8", "--warmup", "0")


@pytest.fixture(scope="module")
def server_url(tiny_glm5):
    """`nano serve TINY_GLM5`, in this process: nano's server on a free loopback port, uvicorn in a thread."""
    from nano import LLM
    from nano.cli.server import Server

    app = Server(LLM(str(tiny_glm5), page_size=16, kv_budget="16MiB", progress=False), str(tiny_glm5),
                 api_key=None, max_queue=64)
    with serving(app):
        yield app.base


def http_bench(model, *flags: str):
    """`nano bench MODEL --json FLAGS`: its one result, and the command's result (stdout: the JSON; stderr: the
    tables and warnings)."""
    result = nano("bench", str(model), "--json", *flags)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    return report, report["runs"][0]["results"][0], result


def check_client_figures(figures: dict) -> None:
    """What a server run measures at the client, in order; and the engine's rows from nano's /metrics."""
    assert figures["failed"] == 0 and figures["errors"] == {}
    for metric in ("ttft", "tpot", "itl", "e2e"):
        stats = figures["latency_ms"][metric]
        assert 0 < stats["median"] <= stats["p95"] <= stats["p99"], metric
    assert figures["latency_ms"]["ttft"]["mean"] < figures["latency_ms"]["e2e"]["mean"]
    assert figures["obtained"]["tokens"] == "the server's usage"
    assert figures["obtained"]["engine"].startswith("the server's /metrics")
    # the server's own counters over the run agree with the client's count of prompt tokens: each one computed
    # or taken from the cache, none recomputed
    cache = figures["prefix_cache"]
    assert cache["prefill_tokens"] + cache["cached_tokens"] == figures["input_tokens"]
    assert figures["preemptions"] == 0 and figures["integrity"]["checked"] > 0
    assert figures["integrity"]["mismatched"] == figures["integrity"]["aborted"] == 0
    assert figures["peak_running"] is None and figures["kv"]["capacity_tokens"] is None   # not in /metrics
    # the server's own mean TTFT runs from the engine's arrival to the first token; the client's from before it
    # sent the request to the first chunk with text, which is at that token or later
    assert 0 < figures["server_latency_ms"]["ttft_mean"] <= figures["latency_ms"]["ttft"]["mean"]
    assert figures["output_tokens_per_chunk"] >= 1


def test_bench_over_http_does_the_work_of_the_offline_bench(server_url, tmp_path, tiny_glm5):
    offline_report = bench_json(tmp_path, tiny_glm5, *HTTP_WORKLOAD)
    offline = offline_report["runs"][0]["results"][0]
    check_run(offline, Workload.random(8, (16, 16), (8, 8), VOCAB, 0), 4, offline_report["wall_s"])
    report, completions, result = http_bench(tiny_glm5, *HTTP_WORKLOAD, "--base-url", server_url + "/v1")
    assert report["mode"] == "server" and report["config"]["engine"] is None
    assert report["config"]["base_url"] == server_url and report["config"]["endpoint"] == "completions"
    assert completions["completed"] == offline["completed"] == 8
    assert completions["input_tokens"] == offline["input_tokens"]          # the same token ids were sent
    assert completions["output_tokens"] == offline["output_tokens"] == completions["output_tokens_requested"]
    check_client_figures(completions)
    # the engine's rows are in the table, "–" where /metrics has no figure
    engine_rows = ("peak running", "preemptions", "KV capacity tokens", "KV peak tokens", "integrity mismatched")
    rows = {line.rsplit(None, 1)[0].strip(): line.split()[-1] for line in result.stderr.splitlines()
            if line.strip().startswith(engine_rows)}
    assert rows == {"peak running": "–", "preemptions": "0", "KV capacity tokens": "–", "KV peak tokens": "–",
                    "integrity mismatched": "0"}
    assert "over HTTP, measured at the client" in " ".join(result.stderr.split())     # the title says how

    _, chat, _ = http_bench(tiny_glm5, *HTTP_WORKLOAD, "--base-url", server_url, "--endpoint", "chat")
    assert chat["completed"] == offline["completed"] and chat["output_tokens"] == offline["output_tokens"]
    # the messages hold 16 of the model's tokens each (cut with its tokenizer, here), and the chat template adds some
    assert chat["input_tokens"] > offline["input_tokens"]
    check_client_figures(chat)


def test_bench_at_a_request_rate_offline_and_over_http(server_url, tmp_path, tiny_glm5):
    rate, seed, prompts = 4.0, 5, 8
    gaps = random.Random(f"{seed} arrivals")
    last_arrival = sum(gaps.expovariate(rate) for _ in range(prompts - 1))      # the first arrives at 0
    assert last_arrival > 1.0                   # long enough that a run without the gaps would be shorter
    flags = (*HTTP_WORKLOAD, "--request-rate", str(rate), "--seed", str(seed))
    workload = Workload.random(prompts, (16, 16), (8, 8), VOCAB, seed)
    offline = bench_json(tmp_path, tiny_glm5, *flags)
    report, over_http, _ = http_bench(tiny_glm5, *flags, "--base-url", server_url)
    for run in (offline, report):
        assert run["config"]["request_rate"] == rate
    for figures in (offline["runs"][0]["results"][0], over_http):
        assert figures["completed"] == prompts
        assert figures["input_tokens"] == sum(map(len, workload.prompts))
        assert figures["output_tokens"] == sum(workload.output_lens)
        assert figures["duration_s"] >= last_arrival
    check_client_figures(over_http)


def test_bench_fails_when_the_server_refuses_every_request(server_url):
    """Nothing was measured: exit 1 with one error line that counts the failures and gives the server's reason
    (after the warning that the server does not serve the model), and no tables of dashes."""
    result = nano("bench", "not-served", *HTTP_WORKLOAD, "--base-url", server_url)
    assert_user_error(result, "every request failed, so nothing was measured: 8 of 8 requests failed; 8 with: "
                              "HTTP 404: the model 'not-served' does not exist", exit_code=1)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "not 'not-served'" in warnings[0]
    assert "completed" not in result.output


def test_bench_unreachable_server_is_one_error_line():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()                                                            # nothing listens there now
    result = nano("bench", "glm-5.2-random", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1")
    assert_user_error(result, f"cannot reach --base-url http://127.0.0.1:{port}", exit_code=1)
    assert result.stderr.count("\n") == 1
    result = nano("bench", "some-org/unknown-model", "--base-url", f"http://127.0.0.1:{port}", "--multi-turn", "2")
    assert_user_error(result, "use --endpoint chat", exit_code=1)


def test_http_records_from_streams_of_every_kind():
    """The client's side on canned streams: tokens from `usage` or from the chunks, and each kind of failure."""
    def events(*bodies) -> httpx.Response:
        text = "".join(f"data: {json.dumps(body)}\n\n" for body in bodies) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    chunk = lambda text, finish=None: {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    answers = {
        1: lambda: events(chunk("ab"), chunk(""), chunk("c", "length"),
                          {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 5}}),
        2: lambda: events(chunk("a"), chunk("b", "length")),                                     # no usage
        3: lambda: events(chunk("a"), {"error": {"message": "KV integrity: aborted", "code": "aborted"}}),
        4: lambda: events(chunk("a")),
        5: lambda: httpx.Response(503, json={"error": {"message": "at capacity", "type": "server_overloaded"}}),
    }
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        return answers[body["prompt"][0]]()

    target = HttpTarget("http://server", "m", "completions")

    async def send_all():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return [await target.send(client, [i], 5) for i in answers]

    usage, chunks, error_event, unfinished, refused = asyncio.run(send_all())
    assert {key: sent[0][key] for key in ("stream", "stream_options", "ignore_eos", "max_tokens", "temperature")} \
        == {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "max_tokens": 5,
            "temperature": 0.0}
    assert (len(usage.output_token_ids), len(usage.token_times), usage.finish_reason) == (5, 2, "length")
    assert usage.text == "abc" and usage.finish_time == usage.token_times[-1]
    assert (len(chunks.output_token_ids), chunks.prompt_token_ids) == (2, [2])      # counted: chunks, ids sent
    assert error_event.error == "KV integrity: aborted" and error_event.finish_reason is None
    assert unfinished.error == "the stream ended without a finish reason"
    assert refused.error == "HTTP 503: at capacity"
    figures = summarize([usage, chunks, error_event, unfinished, refused], 1.0, 4, None, chunked=True)
    assert (figures["completed"], figures["failed"], figures["output_tokens"]) == (2, 3, 7)
    # TPOT over the tokens the server counted: (end - first chunk) / 4 for the first, / 1 for the second
    expected = [(r.finish_time - r.token_times[0]) / (len(r.output_token_ids) - 1) * 1e3 for r in (usage, chunks)]
    assert figures["latency_ms"]["tpot"]["mean"] == pytest.approx(sum(expected) / 2)
    assert figures["peak_running"] is None and set(figures["errors"]) == {error_event.error, unfinished.error,
                                                                            refused.error}
