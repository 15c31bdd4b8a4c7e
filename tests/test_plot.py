"""`--plot FILE` (cli/plot.py): every chart drawn from a small fixed report, not a live run, and read back the way a
reader reads it: the SVG's text (title, axes, legend, caption), one series per configuration in each panel, the
plotted values against the report's figures (ratios worked out here by hand); then the flag's plumbing on the
tiny checkpoint, and its refusals (a missing extra, a wrong suffix, nothing to draw) before any work."""
from __future__ import annotations

import copy
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fixtures import assert_user_error, nano
from nano.cli import blog
from nano.cli.plot import blog_chart, eval_chart, profile_chart, save, sweep_chart, sweep_text_chart

SVG = "{http://www.w3.org/2000/svg}"
ENVIRONMENT = {"cpu": "Test CPU", "torch_threads": 2, "gpu": None, "load_average": 1.5}


def level(concurrency: int, tok_s: float, peak: int, ttft: float = 100.0, tpot: float = 20.0) -> dict:
    return {"concurrency": concurrency, "output_tok_s": tok_s, "peak_running": peak,
            "latency_ms": {"ttft": {"median": ttft}, "tpot": {"median": tpot}}}


# BF16 KV saturates at 32 requests, FP8 runs all 64: the report's picture
SWEEP = {"model": "glm-5.2-random", "mode": "sweep",
         "config": {"num_prompts": None, "input_len": "100", "output_len": "32", "seed": 0},
         "runs": [{"name": "kv-dtype=bf16", "engine": {"kv_budget": "11300000"},
                   "results": [level(1, 20.0, 1), level(16, 80.0, 16), level(64, 100.0, 32)]},
                  {"name": "kv-dtype=fp8", "engine": {"kv_budget": "11300000"},
                   "results": [level(1, 19.0, 1), level(16, 84.0, 16), level(64, 125.0, 64)]}],
         "environment": ENVIRONMENT}
BLOG = {"model": "glm-5.2-random", "published": blog.PUBLISHED,
        "measured": {"kv_capacity_ratio": 1.94, "bf16_saturation": 32, "fp8_concurrency": 61,
                     "kv_peak_throughput_ratio": 1.23, "int4_decode_ratio": 1.5, "int4_prefill_ratio": 0.9,
                     "integrity_throughput_cost": 0.004, "integrity_share_of_step": 0.003,
                     "integrity_p95_cost": -0.01, "run_to_run_noise": {"throughput": 0.02, "p95": 0.03},
                     "paired_ratios": {"int4_decode_ratio": [1.3, 1.5, 1.7], "int4_prefill_ratio": [0.8, 0.9, 1.1],
                                       "kv_peak_throughput_ratio": [1.2, 1.26]},
                     "fp8_kv_top1_delta": {"value": 0.001, "low": -0.002, "high": 0.004},
                     "int4_top1_delta": {"value": -0.004, "low": -0.008, "high": 0.0}},
        "holds": {"kv_peak_throughput_ratio": True, "int4_decode_ratio": True, "int4_prefill_ratio": None,
                  "integrity_share_of_step": True, "integrity_throughput_cost": True, "integrity_p95_cost": None,
                  "fp8_kv_top1_delta": True, "int4_top1_delta": True},
        "obtained": {**dict.fromkeys(("kv_peak_throughput_ratio", "int4_decode_ratio", "int4_prefill_ratio",
                                      "integrity_share_of_step", "integrity_throughput_cost", "integrity_p95_cost",
                                      "fp8_kv_top1_delta", "int4_top1_delta"), "measured"),
                     "kv_capacity_ratio": "by construction", "bf16_saturation": "by construction"},
        "environment": ENVIRONMENT}
COMPONENTS = {"attention": 30.0, "router": 5.0, "routed experts": 50.0, "sampler": 15.0}


def roof(ms: float, read: float, flops: float, rows: int, gemm: float) -> dict:
    gflop_s = flops / ms / 1e6
    return {"step_ms": ms, "bytes_read": read, "gb_s": read / ms / 1e6, "share_of_copy": read / ms / 1e6 / 20.0,
            "flops": flops, "gflop_s": gflop_s, "dense_gemm_gflop_s": gemm, "dense_gemm_shape": [rows, 512, 2048],
            "share_of_gemm": gflop_s / gemm}


PROFILE = {"model": "glm-5.2-random", "times": "CPU time", "copy_gb_s": 20.0, "environment": ENVIRONMENT,
           "prefill": {"tokens": 256, "ms": COMPONENTS, "roofline": roof(100.0, 2e8, 4e9, 256, 80.0)},
           "decode": {"batch": 8, "ms": COMPONENTS, "roofline": roof(40.0, 1.5e8, 2e8, 8, 20.0)}}


def context(size: int, delta: float, kl: float) -> dict:
    return {"context": size, "delta_bits_per_byte": {"value": delta, "low": delta - 0.002, "high": delta + 0.002},
            "kl_mean": {"value": kl, "low": kl / 2, "high": kl * 2}}


EVAL = {"label": "trained nano stand-in of kimi-k2.6", "contexts": [{"context": 256}, {"context": 1024}],
        "reference": {"setup": {"prefill_weights": "bf16", "kv_dtype": "bf16", "dtype": "bfloat16"}},
        "configurations": [{"name": "kv-dtype=fp8", "contexts": [context(256, 0.002, 3.5e-3),
                                                                 context(1024, 0.007, 1.8e-2)]},
                           {"name": "weights=int4", "contexts": [context(256, 0.01, 2e-2),
                                                                 context(1024, 0.012, 3e-2)]}],
        "settings": {"max_tokens": 16384, "resamples": 1000, "seed": 0}, "text": {"path": "/x/heldout.txt"},
        "environment": ENVIRONMENT}


def drawn(chart, report: dict, tmp_path: Path) -> tuple[str, dict[str, list[str]], object]:
    """Save the chart as SVG and read it back: its text (one string), its series ids by panel, and the figure."""
    figure = chart(copy.deepcopy(report))
    path = tmp_path / "chart.svg"
    save(figure, path)
    assert path.stat().st_size > 10_000
    root = ET.parse(path).getroot()
    text = " ".join("".join(node.itertext()) for node in root.iter(f"{SVG}text"))
    series: dict[str, list[str]] = {}
    for node in root.iter(f"{SVG}g"):
        panel, slash, name = (node.get("id") or "").partition("/")
        if slash and name not in series.setdefault(panel, []):   # a series may be several groups (bars, caps)
            series[panel].append(name)
    return text, series, figure


def series_data(figure, gid: str) -> list[tuple[float, float]]:
    line = next(line for ax in figure.axes for line in ax.get_lines() if line.get_gid() == gid)
    return list(zip(line.get_xdata(), line.get_ydata()))


# ---- the charts, from fixed reports ------------------------------------------------------------------------------
def test_sweep_chart_a_line_per_configuration_the_saturation_marked_and_the_ratio(tmp_path):
    text, series, figure = drawn(sweep_chart, SWEEP, tmp_path)
    for panel in ("output", "ttft", "tpot"):
        assert series[panel] == ["kv-dtype-bf16", "kv-dtype-fp8"]
    assert series["ratio"] == ["kv-dtype-fp8"]                           # each against the first
    for words in ("glm-5.2-random: throughput and latency against concurrency", "KV budget 11300000",
                  "5 × concurrency prompts a level", "output tok/s", "TTFT p50, ms", "TPOT p50, ms",
                  "concurrency (requests in flight)", "kv-dtype=bf16", "kv-dtype=fp8",
                  "kv-dtype=bf16: at most 32 running",                       # BF16 ran 32 of the 64 sent
                  "kv-dtype=fp8 / kv-dtype=bf16", "measured here on Test CPU, torch threads: 2; load average 1.5"):
        assert words in text, words
    assert "kv-dtype=fp8: at most" not in text                           # FP8 ran all it was sent
    assert series_data(figure, "output/kv-dtype-fp8") == [(1, 19.0), (16, 84.0), (64, 125.0)]
    assert series_data(figure, "ratio/kv-dtype-fp8") == pytest.approx([(1, 0.95), (16, 1.05), (64, 1.25)])


def test_sweep_chart_of_one_configuration_has_no_ratio_panel(tmp_path):
    one = {**SWEEP, "runs": SWEEP["runs"][1:]}
    text, series, figure = drawn(sweep_chart, one, tmp_path)
    assert set(series) == {"output", "ttft", "tpot"} and len(figure.axes) == 3
    assert "ratio to the first" not in text and "at most" not in text


def test_the_text_chart_under_a_sweep_draws_bars_to_scale():
    chart = sweep_text_chart([(run["name"], run["results"]) for run in SWEEP["runs"]], width=40)
    lines = chart.splitlines()
    assert "the longest bar is 125.0 tok/s" in lines[0]
    fp8_64 = next(line for line in lines if line.rstrip().endswith("125.0"))
    assert fp8_64.count("█") == 40                                       # the longest: the whole width
    bf16_64 = next(line for line in lines if "100.0" in line)
    assert bf16_64.count("█") == 32 and bf16_64.rstrip().endswith("at most 32 running")   # 100 / 125 of 40 cells
    half = next(line for line in lines if line.rstrip().endswith(" 20.0"))
    assert half.count("█") == 6 and "▍" in half                          # 20 / 125 × 40 = 6.4 cells: 6 and 3/8
    assert len(lines) == 1 + 6 and [line.split()[0] for line in lines[1::2]] == ["1", "16", "64"]


def test_blog_chart_labels_every_figure_with_how_it_was_obtained(tmp_path):
    text, series, figure = drawn(blog_chart, BLOG, tmp_path)
    for panel in ("ratios", "running", "integrity"):
        assert series[panel] == ["published", "here"]
    assert series["accuracy"] == ["here"]
    for words in ("the published results at small scale", "measured on Test CPU", "published (quoted)",
                  "1.94× by construction", "1.23× measured · holds: yes", "0.90× measured · holds: within noise",
                  "1.53× quoted", "32 by construction", "61 measured", "64 quoted", "0.30% measured · holds: yes",
                  "< 1% quoted (a bound)", "0.38–0.79% quoted", "here, by construction",
                  "within ±1 point (the report's claim)", "+0.10 measured · holds: yes",
                  "ratio (×); 1 = no change", "requests running at once, at most (requests)",
                  "Δ top-1 accuracy, points", "quoted from the report"):
        assert words in text, words
    ratios = next(ax for ax in figure.axes if ax.get_title() == "capacity and speed")
    quoted = [1_370_000 / 686_000, 2192 / 1558, 92 / 60, 8660 / 10160]   # the report's figures
    assert sorted(p.get_width() for p in ratios.patches) == pytest.approx(sorted([1.94, 1.23, 1.5, 0.9, *quoted]))


def test_blog_chart_without_a_trained_stand_in_says_accuracy_was_not_measured(tmp_path):
    report = copy.deepcopy(BLOG)
    for key in ("fp8_kv_top1_delta", "int4_top1_delta"):
        del report["measured"][key], report["holds"][key]
    text, series, _ = drawn(blog_chart, report, tmp_path)
    assert "not measured: this preset has no trained stand-in" in text and "accuracy" not in series


def test_profile_chart_puts_each_step_under_its_roofs(tmp_path):
    text, series, figure = drawn(profile_chart, PROFILE, tmp_path)
    assert series["roof"] == ["bandwidth", "prefill", "decode"]
    assert series["split"] == ["attention", "router", "routed-experts", "sampler"]   # one per component
    for words in ("copy bandwidth 20.0 GB/s", "dense GEMM, 256 rows: 80.0 GFLOP/s", "dense GEMM, 8 rows: 20.0 "
                  "GFLOP/s", "prefill step: 100.0 ms", "decode step: 40.0 ms", "arithmetic intensity, FLOP per "
                  "byte read", "GFLOP/s", "share of the step's profiled time, % (CPU time)",
                  "prefill: 1 × 256 tokens · decode: batch 8", "measured here on Test CPU",
                  "By construction: the bytes a step reads"):
        assert words in text, words
    # 4 GFLOP over 200 MB: 20 FLOP a byte, at 4e9 / 0.1 s = 40 GFLOP/s; the decode step 2e8 / 1.5e8 at 5 GFLOP/s
    assert series_data(figure, "roof/prefill") == pytest.approx([(20.0, 40.0)])
    assert series_data(figure, "roof/decode") == pytest.approx([(4 / 3, 5.0)])
    split = next(ax for ax in figure.axes if ax.get_title() == "where a step's time goes")
    assert sorted(round(p.get_width(), 6) for p in split.patches) == sorted([30.0, 5.0, 50.0, 15.0] * 2)


def test_eval_chart_plots_each_configuration_against_context_with_intervals(tmp_path):
    text, series, figure = drawn(eval_chart, EVAL, tmp_path)
    assert series["delta"] == series["kl"] == ["kv-dtype-fp8", "weights-int4"]
    for words in ("trained nano stand-in of kimi-k2.6", "Δ bits per byte vs the reference",
                  "KL mean, nats per token", "KL(reference ‖ configuration) per token",
                  "context, tokens per window", "256", "1,024",
                  "kv-dtype=fp8", "weights=int4", "95% bootstrap intervals", "heldout.txt", "Test CPU"):
        assert words in text, words
    assert series_data(figure, "kl/kv-dtype-fp8") == pytest.approx([(256, 3.5e-3), (1024, 1.8e-2)])
    delta = next(ax for ax in figure.axes if "Δ bits" in ax.get_ylabel())
    caps = [line for line in delta.get_lines() if line.get_gid() is None and len(line.get_xdata()) == 2]
    assert caps, "error bars drawn"


def test_png_too(tmp_path):
    path = tmp_path / "sweep.png"
    save(sweep_chart(copy.deepcopy(SWEEP)), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


# ---- the flag ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["bench", "glm-5.2-random", "--sweep-concurrency", "1,2"],
    ["bench", "glm-5.2-random", "--reproduce-blog"],
    ["profile", "glm-5.2-random"],
    ["eval", "glm-5.2", "--compare", "kv-dtype=bf16,fp8"],
])
def test_without_the_extra_plot_is_one_error_line_before_any_work(args, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # as if not installed: `import matplotlib` fails
    result = nano(*args, "--plot", str(tmp_path / "chart.svg"))
    assert_user_error(result, "--plot needs the plot extra: pip install -e '.[plot]'", exit_code=1)
    assert result.stderr.count("\n") == 1 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, message, code", [
    (["bench", "glm-5.2-random", "--sweep-concurrency", "1,2", "--plot", "chart.pdf"], "must end in .png or .svg", 2),
    (["bench", "glm-5.2-random", "--plot", "chart.svg"], "--plot draws --sweep-concurrency or --reproduce-blog", 2),
    (["profile", "glm-5.2-random", "--plot", "/no/such/folder/chart.png"], "does not exist", 1),
    (["bench", "glm-5.2-random", "--compare", "kv-dtype=bf16,fp8", "--reproduce-blog"], "cannot be combined", 2),
])
def test_plot_refusals(args, message, code):
    result = nano(*args)
    assert_user_error(result, message, exit_code=code)
    assert result.stderr.count("\n") == 1


def test_bench_sweep_with_compare_draws_the_chart_and_the_text_chart(tmp_path, tiny_glm5):
    """--sweep-concurrency with --compare kv-dtype=bf16,fp8 under a budget of 8 BF16 requests (40 + 8 tokens fill
    three 16-token pages): at 16 in flight BF16 runs at most 8 and FP8 all 14 its pool holds (see test_bench.py)."""
    from test_bench import BF16
    budget = 8 * 3 * 16 * BF16
    path = tmp_path / "sweep.svg"
    result = nano("bench", str(tiny_glm5), "--sweep-concurrency", "2,16", "--num-prompts", "16", "--input-len", "40",
                  "--output-len", "8", "--page-size", "16", "--kv-budget", str(budget), "--warmup", "0",
                  "--compare", "kv-dtype=bf16,fp8", "--plot", str(path))
    assert result.exit_code == 0, result.output
    chart = result.stdout[result.stdout.index("output tok/s against concurrency"):].splitlines()
    assert chart[3].split()[:2] == ["16", "kv-dtype=bf16"] and chart[3].endswith("at most 8 running")
    assert chart[4].endswith("at most 14 running")
    root = ET.parse(path).getroot()
    ids = [node.get("id") for node in root.iter(f"{SVG}g") if "/" in (node.get("id") or "")]
    assert ids == ["output/kv-dtype-bf16", "output/kv-dtype-fp8", "ttft/kv-dtype-bf16", "ttft/kv-dtype-fp8",
                   "tpot/kv-dtype-bf16", "tpot/kv-dtype-fp8", "ratio/kv-dtype-fp8"]
    text = " ".join("".join(node.itertext()) for node in root.iter(f"{SVG}text"))
    assert "kv-dtype=bf16: at most 8 running" in text and "kv-dtype=fp8: at most 14 running" in text
    assert f"wrote {path}" in result.stderr


def test_profile_plot_on_the_tiny_checkpoint(tmp_path, tiny_glm5):
    path = tmp_path / "profile.png"
    result = nano("profile", str(tiny_glm5), "--batch", "2", "--input-len", "16", "--steps", "1", "--plot", str(path))
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:4] == b"\x89PNG" and f"wrote {path}" in result.stderr
