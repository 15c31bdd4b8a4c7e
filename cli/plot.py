"""`--plot FILE`: the charts of `nano bench --sweep-concurrency`, `--reproduce-blog`, `nano profile` and
`nano eval`, and the text chart under a sweep's tables.

A chart is drawn from the same JSON report the command prints with --json (`--output FILE` writes it), so what
a chart shows and the figures behind it are one thing, and a test can draw every chart from a small fixed report.
Each chart has a title (the model, the workload, the device), axes with units, a legend, and a caption saying how
its figures were obtained: measured here (on which device, at what load), quoted from the report, or by
construction.

matplotlib is an optional extra (`pip install -e '.[plot]'`): `check_plot` runs before any work, so a missing
extra, a wrong suffix or an unwritable path costs one error line, not a benchmark's result. An SVG keeps its text
as text (a reader can search it, a test can read it) and carries no date: the same figures give the same file.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from nano.errors import NanoError, UsageError

from .console import check_output_path, err

if TYPE_CHECKING:   # matplotlib loads only when a chart is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SUFFIXES = (".png", ".svg")
EXTRA = "pip install -e '.[plot]' (matplotlib)"
PUBLISHED_COLOR, MEASURED_COLOR = "#9e9e9e", "#1f77b4"
BARS = " ▏▎▍▌▋▊▉█"      # the text chart's bar ends: eighths of a cell


def plot_option(chart: str) -> Any:
    """A command's `--plot FILE` option; `chart` says what it draws."""
    return Annotated[Path | None, typer.Option(
        metavar="FILE", help=f"{chart} to FILE (.png or .svg; needs the plot extra: {EXTRA}).")]


def check_plot(path: Path) -> None:
    """Before any work: a .png or .svg path that can be written, and matplotlib installed."""
    if path.suffix.lower() not in SUFFIXES:
        raise UsageError(f"--plot {path}: the file must end in .png or .svg")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise NanoError(f"--plot needs the plot extra: {EXTRA}") from None
    check_output_path("--plot", path)


def save(figure: Figure, path: Path) -> None:
    """Write the chart (the format from the suffix) and say so on stderr."""
    import matplotlib
    svg = path.suffix.lower() == ".svg"
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "nano"}):
        try:
            figure.savefig(path.expanduser(), bbox_inches="tight", dpi=150,
                           metadata={"Date": None} if svg else {"Software": None})
        except OSError as error:
            raise NanoError(f"--plot {path}: {error.strerror or error}") from None
    err.print(f"wrote {path}", style="dim", markup=False)


def new_figure(columns: int, rows: int = 1, width: float = 5.0, height: float = 3.6) -> tuple[Figure, list[Axes]]:
    from matplotlib.figure import Figure
    figure = Figure(figsize=(width * columns, height * rows), layout="constrained")
    return figure, list(figure.subplots(rows, columns, squeeze=False).flat)


def series_id(panel: str, name: str) -> str:
    """A series' id in the SVG (`<g id="...">`): its panel and configuration."""
    return f"{panel}/{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}"


def caption(figure: Figure, text: str) -> None:
    figure.text(0.0, -0.02, text, ha="left", va="top", fontsize=8, wrap=True, transform=figure.transFigure)


def measured_on(environment: dict[str, Any]) -> str:
    """The device of a report's environment (cli/machine.py), with the load it was measured at."""
    device = environment.get("gpu") or f"{environment['cpu']}, torch threads: {environment['torch_threads']}"
    load = environment.get("load_average")
    return device + (f"; load average {load:.1f} at the end" if load is not None else "")


def levels_axis(ax: Axes, levels: list[int], label: str) -> None:
    """A log-2 axis with a tick at each level (concurrency, context length)."""
    if len(levels) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [f"{level:,}" for level in levels])
    ax.minorticks_off()
    ax.set_xlabel(label)


# ---- nano bench --sweep-concurrency ------------------------------------------------------------------------------
SWEEP_PANELS = [("output", "output tok/s", lambda f: f["output_tok_s"]),
                ("ttft", "TTFT p50, ms", lambda f: f["latency_ms"]["ttft"]["median"]),
                ("tpot", "TPOT p50, ms", lambda f: f["latency_ms"]["tpot"]["median"])]


def sweep_chart(report: dict[str, Any]) -> Figure:
    """Output tok/s, TTFT p50 and TPOT p50 against concurrency, one line per configuration; where a
    configuration ran fewer requests at once than were in flight, a dotted line marks the most it ran. With two or
    more configurations, a fourth panel: each one's output tok/s over the first's."""
    runs = report["runs"]
    figure, axes = new_figure(2, 2) if len(runs) > 1 else new_figure(3)
    for number, run in enumerate(runs):
        color = f"C{number}"
        levels = [f["concurrency"] for f in run["results"]]
        for ax, (panel, label, get) in zip(axes, SWEEP_PANELS):
            ax.plot(levels, [get(f) for f in run["results"]], "o-", color=color, label=run["name"],
                    gid=series_id(panel, run["name"]))
            ax.set_ylabel(label)
            levels_axis(ax, levels, "concurrency (requests in flight)")
        peak = max(f["peak_running"] for f in run["results"])
        if peak < max(levels):   # the pool held fewer than were sent
            axes[0].axvline(peak, color=color, linestyle=":", label=f"{run['name']}: at most {peak} running")
    if len(runs) > 1:
        first = {f["concurrency"]: f["output_tok_s"] for f in runs[0]["results"]}
        for number, run in enumerate(runs[1:], 1):
            name = f"{run['name']} / {runs[0]['name']}"
            pairs = [(f["concurrency"], f["output_tok_s"] / first[f["concurrency"]]) for f in run["results"]
                     if first.get(f["concurrency"])]
            axes[3].plot(*zip(*pairs), "o-", color=f"C{number}", label=name, gid=series_id("ratio", run["name"]))
        axes[3].axhline(1.0, color="black", linewidth=0.8)
        axes[3].set_ylabel("output tok/s, ratio to the first")
        levels_axis(axes[3], [f["concurrency"] for f in runs[0]["results"]], "concurrency (requests in flight)")
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    config, engine = report["config"], runs[0]["engine"] or {}
    prompts = config["num_prompts"] or "5 × concurrency"
    budget = f" · KV budget {engine['kv_budget']}" if engine.get("kv_budget") else ""
    figure.suptitle(f"{report['model']}: throughput and latency against concurrency\n{prompts} prompts a level · input "
                    f"{config['input_len']} · output {config['output_len']} tokens{budget} · seed {config['seed']}\n"
                    f"measured here on {measured_on(report['environment'])}")
    caption(figure, "Every point measured here: nano bench, one run per point, the configurations one after another "
                    "in one process; peak: the most requests running at once.")
    return figure


def sweep_text_chart(runs: list[tuple[str, list[dict[str, Any]]]], width: int = 40) -> str:
    """Output tok/s at each concurrency, a bar per configuration, for the terminal (no extra needed)."""
    top = max(f["output_tok_s"] for _, results in runs for f in results) or 1.0
    name_width = max(len(name) for name, _ in runs) if len(runs) > 1 else 0
    lines = [f"output tok/s against concurrency (measured here; the longest bar is {top:,.1f} tok/s)"]
    for index, level in enumerate(f["concurrency"] for f in runs[0][1]):
        for number, (name, results) in enumerate(runs):
            figures = results[index]
            eighths = round(width * 8 * figures["output_tok_s"] / top)
            bar = "█" * (eighths // 8) + BARS[eighths % 8].strip()
            head = f"{level:>5}" if number == 0 else " " * 5
            peak = figures["peak_running"]
            note = f"  at most {peak} running" if peak < level else ""
            lines.append(f"{head}  {name:<{name_width}}{'  ' if name_width else ''}{bar:<{width + 1}}"
                         f"{figures['output_tok_s']:>9,.1f}{note}")
    return "\n".join(lines)


# ---- nano bench --reproduce-blog ---------------------------------------------------------------------------------
BLOG_RATIOS = [("kv_capacity_ratio", "tokens that fit,\nFP8 / BF16 KV"),
               ("kv_peak_throughput_ratio", "peak throughput,\nFP8 / BF16 KV"),
               ("int4_decode_ratio", "decode tok/s, batch 1,\nINT4 / FP8 weights"),
               ("int4_prefill_ratio", "prefill tok/s,\nINT4 / FP8 weights")]
BLOG_COSTS = [("integrity_share_of_step", "check's share\nof step time"),
              ("integrity_throughput_cost", "throughput cost,\nend to end"),
              ("integrity_p95_cost", "p95 TPOT cost,\nend to end")]
BLOG_ACCURACY = [("fp8_kv_top1_delta", "FP8 KV vs BF16 KV"), ("int4_top1_delta", "INT4 experts vs BF16")]


def provenance(report: dict[str, Any], key: str, figure: str) -> str:
    """'1.23× measured · holds: yes', '1.94× by construction': a figure of this run, how it was obtained, and for a
    measured one its verdict."""
    how = report["obtained"].get(key, "measured")
    verdict = {True: "yes", False: "no", None: "within noise"}[report["holds"][key]] if key in report["holds"] else ""
    return f"{figure} {how}" + (f" · holds: {verdict}" if how == "measured" and verdict else "")


def paired_bars(ax: Axes, report: dict[str, Any], panel: str, rows: list[tuple[str, str]], quoted: list[float],
                here: list[float], here_range: list[tuple[float, float] | None], fmt: str,
                quoted_labels: list[str] | None = None) -> None:
    """Two horizontal bars per row (key, label): quoted (grey) above, this run's below (hatched when by
    construction), with its range as an error bar; each labelled past its bar's (or error bar's) end."""
    y = list(range(len(rows)))[::-1]
    ax.barh([v + 0.2 for v in y], quoted, 0.38, color=PUBLISHED_COLOR, gid=series_id(panel, "published"))
    bars = ax.barh([v - 0.2 for v in y], here, 0.38, color=MEASURED_COLOR, gid=series_id(panel, "here"))
    for bar, (key, _) in zip(bars, rows):
        if report["obtained"].get(key) == "by construction":
            bar.set(hatch="//", facecolor="white", edgecolor=MEASURED_COLOR)
    ends = [max(0.0, value, spread[1] if spread else value) for value, spread in zip(here, here_range)]
    for v, spread, value in zip(y, here_range, here):
        if spread is not None:
            ax.errorbar(value, v - 0.2, xerr=[[value - spread[0]], [spread[1] - value]], color="black", capsize=3)
    labels = quoted_labels or [f"{fmt.format(value)} quoted" for value in quoted]
    for v, value, label in zip(y, quoted, labels):
        ax.annotate(label, (max(0.0, value), v + 0.2), xytext=(4, 0), textcoords="offset points", va="center",
                    fontsize=7)
    for v, value, end, (key, _) in zip(y, here, ends, rows):
        ax.annotate(provenance(report, key, fmt.format(value)), (end, v - 0.2), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(y, [text for _, text in rows], fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlim(1.3 * min([0.0, *(s[0] for s in here_range if s)]), 2.0 * max([*quoted, *ends]))


def accuracy_panel(ax: Axes, report: dict[str, Any]) -> None:
    """Δ top-1 accuracy with its 95% interval, against the report's ±1-point claim."""
    measured = report["measured"]
    accuracy = [(key, text) for key, text in BLOG_ACCURACY if key in measured]
    ax.axvspan(-1, 1, color="#d9ead3", label="within ±1 point (the report's claim)")
    if accuracy:
        points = [100 * measured[key]["value"] for key, _ in accuracy]
        y = list(range(len(accuracy)))[::-1]
        ax.errorbar(points, y, xerr=[[p - 100 * measured[k]["low"] for p, (k, _) in zip(points, accuracy)],
                                     [100 * measured[k]["high"] - p for p, (k, _) in zip(points, accuracy)]],
                    fmt="o", color=MEASURED_COLOR, capsize=3, label="here, with its 95% interval",
                    gid=series_id("accuracy", "here"))
        for v, point, (key, _) in zip(y, points, accuracy):
            ax.annotate(provenance(report, key, f"{point:+.2f}"), (point, v), xytext=(0, 8),
                        textcoords="offset points", ha="center", fontsize=7)
        ax.set_yticks(y, [text for _, text in accuracy], fontsize=8)
        ax.set_ylim(-0.7, len(accuracy) - 0.3)
    else:
        ax.text(0, 0.5, "not measured: this preset has no trained stand-in", ha="center",
                transform=ax.get_yaxis_transform())
    widest = max([2.0, *(120 * abs(measured[key][end]) for key, _ in accuracy for end in ("low", "high"))])
    ax.set_xlim(-widest, widest)
    ax.set_xlabel("Δ top-1 accuracy, points (nano eval; quoted: MMLU +0.07 for FP8 KV)")
    ax.set_title("accuracy", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")


def blog_chart(report: dict[str, Any]) -> Figure:
    """The report's figures (quoted) beside this run's (measured, or by construction), each bar labelled with its
    provenance and, for a measured one, its verdict."""
    from matplotlib.patches import Patch
    published, measured = report["published"], report["measured"]
    figure, (ratio_ax, running_ax, cost_ax, accuracy_ax) = new_figure(2, 2, width=6.5, height=4.0)
    ratios = measured["paired_ratios"]
    paired_bars(ratio_ax, report, "ratios", BLOG_RATIOS, [published[key] for key, _ in BLOG_RATIOS],
                [measured[key] for key, _ in BLOG_RATIOS],
                [(min(ratios[key]), max(ratios[key])) if ratios.get(key) else None for key, _ in BLOG_RATIOS],
                "{:.2f}×")
    ratio_ax.axvline(1.0, color="black", linewidth=0.8)
    ratio_ax.set_xlabel("ratio (×); 1 = no change")
    ratio_ax.set_title("capacity and speed", fontsize=10)

    paired_bars(running_ax, report, "running", [("bf16_saturation", "BF16 KV"), ("fp8_concurrency", "FP8 KV")],
                [published["bf16_saturation"], published["fp8_concurrency"]],
                [measured["bf16_saturation"], measured["fp8_concurrency"]], [None, None], "{:.0f}")
    running_ax.set_xlabel("requests running at once, at most (requests)")
    running_ax.set_title("concurrency under one KV budget", fontsize=10)

    noise = measured["run_to_run_noise"]
    costs = [100 * measured[key] for key, _ in BLOG_COSTS]
    spreads = [None, *((c - 100 * noise[n], c + 100 * noise[n]) for c, n in zip(costs[1:], ("throughput", "p95")))]
    # quoted: the share's "< 1%" is a bound, drawn at 1; the end-to-end costs are ranges, drawn at their middle
    quoted_costs = [1.0, *(50 * sum(published[key]) for key, _ in BLOG_COSTS[1:])]
    paired_bars(cost_ax, report, "integrity", BLOG_COSTS, quoted_costs, costs, spreads, "{:.2f}%",
                ["< 1% quoted (a bound)", *(f"{100 * low:.2f}–{100 * high:.2f}% quoted" for low, high in
                                            (published[key] for key, _ in BLOG_COSTS[1:]))])
    cost_ax.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
    cost_ax.set_xlabel("cost, % (quoted ranges drawn at their middle, the < 1% bound at 1)")
    cost_ax.set_title("integrity check", fontsize=10)

    accuracy_panel(accuracy_ax, report)
    running_ax.legend(handles=[Patch(color=PUBLISHED_COLOR, label="published (quoted)"),   # every bar panel's
                               Patch(color=MEASURED_COLOR, label="here, measured"),
                               Patch(hatch="//", facecolor="white", edgecolor=MEASURED_COLOR,
                                     label="here, by construction")], loc="upper right", fontsize=8)
    layout = f" · FP8 KV in the {report['fp8_kv_layout']} layout" if "fp8_kv_layout" in report else ""
    figure.suptitle(f"{report['model']}: the published results at small scale{layout}\nhere: measured on "
                    f"{measured_on(report['environment'])}, except bars by construction (hatched)")
    caption(figure, "published: quoted from the report, Kimi K2.6 (KV, integrity) and GLM-5.2 (weights) on H200 "
                    "nodes. here: nano bench --reproduce-blog in one process; error bars: the range of the paired "
                    "ratios (INT4), ± the run-to-run noise (integrity), the 95% paired-bootstrap interval (accuracy). "
                    "by construction: fixed by the set-up (the pool's arithmetic, the budget), so no verdict.")
    return figure


# ---- nano profile ------------------------------------------------------------------------------------------------
def profile_chart(report: dict[str, Any]) -> Figure:
    """The roofline of this machine (its copy bandwidth and dense GEMMs, measured in the same run) with the prefill
    and decode steps as points, and each step's time split by component."""
    figure, (roof_ax, split_ax) = new_figure(2, width=5.8, height=4.2)
    bandwidth = report["copy_gb_s"]
    steps = {phase: report[phase]["roofline"] for phase in ("prefill", "decode")}
    intensity = {phase: roof["flops"] / roof["bytes_read"] for phase, roof in steps.items()}
    low, high = min(intensity.values()) / 8, max(intensity.values()) * 8
    roof_ax.plot([low, high], [bandwidth * low, bandwidth * high], color="black", linewidth=1,
                 label=f"copy bandwidth {bandwidth:.1f} GB/s", gid=series_id("roof", "bandwidth"))
    for number, (phase, roof) in enumerate(steps.items()):
        rows = roof["dense_gemm_shape"][0]
        roof_ax.axhline(roof["dense_gemm_gflop_s"], color=f"C{number}", linestyle="--", linewidth=1,
                        label=f"dense GEMM, {rows} rows: {roof['dense_gemm_gflop_s']:.1f} GFLOP/s")
        roof_ax.plot(intensity[phase], roof["gflop_s"], "o", color=f"C{number}", markersize=8,
                     label=f"{phase} step: {roof['step_ms']:.1f} ms", gid=series_id("roof", phase))
        roof_ax.annotate(f"{phase}\n{100 * roof['share_of_copy']:.0f}% of copy, {100 * roof['share_of_gemm']:.0f}% "
                         f"of GEMM", (intensity[phase], roof["gflop_s"]), xytext=(6, -4),
                         textcoords="offset points", fontsize=7, va="top")
    roof_ax.set_xscale("log")
    roof_ax.set_yscale("log")
    roof_ax.set_ylim(min(roof["gflop_s"] for roof in steps.values()) / 4, None)
    roof_ax.set_xlabel("arithmetic intensity, FLOP per byte read")
    roof_ax.set_ylabel("GFLOP/s")
    roof_ax.set_title("roofline", fontsize=10)
    roof_ax.grid(alpha=0.3, which="both")
    roof_ax.legend(fontsize=7, loc="upper left")
    names = list(report["prefill"]["ms"])
    left = {phase: 0.0 for phase in steps}
    for number, name in enumerate(names):
        totals = {phase: sum(report[phase]["ms"].values()) or 1.0 for phase in steps}
        shares = [100 * report[phase]["ms"][name] / totals[phase] for phase in steps]
        split_ax.barh(list(steps), shares, left=[left[p] for p in steps], color=f"C{number % 10}",
                      hatch="//" if number >= 10 else None, label=name, gid=series_id("split", name))
        for phase, share in zip(steps, shares):
            left[phase] += share
    split_ax.set_xlim(0, 100)
    split_ax.set_xlabel(f"share of the step's profiled time, % ({report['times']})")
    split_ax.set_title("where a step's time goes", fontsize=10)
    split_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    prefill, decode = report["prefill"], report["decode"]
    figure.suptitle(f"{report['model']} · prefill: 1 × {prefill['tokens']} tokens · decode: batch {decode['batch']}\n"
                    f"measured here on {measured_on(report['environment'])}")
    caption(figure, "nano profile. Measured in one run: the steps' unprofiled times, the copy bandwidth (read + "
                    "write), the dense GEMMs of the steps' rows in the model's dtype, and the components' times. "
                    "Counted: the matmul FLOPs (FlopCounterMode). By construction: the bytes a step reads (the "
                    "weights it uses, only the routed experts its tokens chose, and the KV of every sequence).")
    return figure


# ---- nano eval ---------------------------------------------------------------------------------------------------
EVAL_PANELS = [("delta", "delta_bits_per_byte", "Δ bits per byte vs the reference"),
               ("kl", "kl_mean", "KL mean, nats per token")]


def eval_chart(document: dict[str, Any]) -> Figure:
    """Each configuration's Δ bits/byte and mean KL against the context length, with their 95% bootstrap
    intervals as error bars."""
    figure, axes = new_figure(2)
    contexts = [windows["context"] for windows in document["contexts"]]
    for number, run in enumerate(document["configurations"]):
        for ax, (panel, field, label) in zip(axes, EVAL_PANELS):
            figures = [c[field] for c in run["contexts"]]
            values = [f["value"] for f in figures]
            ax.errorbar(contexts, values, yerr=[[v - f["low"] for v, f in zip(values, figures)],
                                                [f["high"] - v for v, f in zip(values, figures)]],
                        fmt="o-", capsize=3, color=f"C{number}", label=run["name"],
                        gid=series_id(panel, run["name"]))
            ax.set_ylabel(label)
    for ax in axes:
        levels_axis(ax, contexts, "context, tokens per window")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].axhline(0.0, color="black", linewidth=0.8)
    axes[1].set_ylim(bottom=0)
    setup, settings, text = document["reference"]["setup"], document["settings"], document["text"]
    figure.suptitle(f"{document['label']}\naccuracy against the reference (weights {setup['prefill_weights']}, KV "
                    f"{setup['kv_dtype']}, {setup['dtype']}) · teacher-forced over {Path(text['path']).name}, "
                    f"first {settings['max_tokens']:,} tokens\nmeasured here on {measured_on(document['environment'])}",
                    fontsize=10)
    caption(figure, "Every point measured here: nano eval. Error bars: 95% bootstrap "
                    f"intervals over windows ({settings['resamples']:,} resamples, seed {settings['seed']}); each Δ "
                    f"resamples the same windows for both sides. KL: KL(reference ‖ configuration) per token.")
    return figure
