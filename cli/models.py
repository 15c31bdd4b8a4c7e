"""`nano models`: the presets (size, experts, attention, KV bytes per token, local checkpoint or stand-in), with
`--capacity` the tokens of context that fit on an 8×H200 node, and with `--capacity --tp N` the per-GPU plan under
nano's tensor / expert parallelism on N ranks (the arithmetic is in capacity.py)."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from nano.config import ModelConfig
from nano.presets import PRESETS, Preset

from . import capacity
from .console import UsageError, format_count, out, user_errors


def sizes(config: ModelConfig) -> dict[str, Any]:
    """A config's size: parameters, layers, hidden size, experts, KV-cache bytes per token."""
    return {"params_total": config.num_parameters(), "params_active": config.num_parameters(active_only=True),
            "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "routed_experts": config.n_routed_experts, "experts_per_token": config.num_experts_per_tok,
            "shared_experts": config.n_shared_experts,
            "kv_bytes_per_token": {"bf16": config.kv_bytes_per_token("bf16"),
                                   "fp8": config.kv_bytes_per_token("fp8", "tensor")}}


def describe_preset(preset: Preset) -> dict[str, Any]:
    """One preset as plain data: the published model's numbers, its nano stand-in, and what runs here."""
    from nano.loader import resolve_model   # torch: once the command line is checked
    real, stand_in = ModelConfig.from_hf(preset.config), ModelConfig.from_hf(preset.nano_config)
    resolved = resolve_model(preset.name)
    return {"name": preset.name, "hub_id": preset.hub_id, **sizes(real),
            "attention": "MLA+DSA" if real.has_indexer else "MLA",
            "weight_bytes": {fmt.lower(): capacity.weight_bytes(real, fmt)
                             for fmt in ("BF16", "FP8", "INT4", "FP8+INT4")},
            "local_checkpoint": str(resolved.path) if resolved.kind == "checkpoint" else None,
            "runs_here": {"checkpoint": "checkpoint", "trained": "trained stand-in", "nano": "random stand-in"}[
                resolved.kind],
            "trained_stand_in": trained_stand_in(preset.name),
            "stand_in": {**sizes(stand_in), "context": stand_in.max_position_embeddings}}


def trained_stand_in(name: str) -> dict[str, Any] | None:
    """The shipped trained stand-in of a preset: its size and held-out bits per byte (as its training measured)."""
    from nano.loader import STANDINS, read_config, trained_record
    record = trained_record(name)
    if record is None:
        return None
    config = ModelConfig.from_hf(read_config(STANDINS / name))
    heldout = record["heldout_figures"]["heldout_1024"]
    return {"params_total": record["parameters"], "params_active": config.num_parameters(active_only=True),
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size,
            "trained_on": record["trained_on"], "heldout_bits_per_byte": heldout["bits_per_byte"],
            "heldout_context": heldout["context"]}


Cell = Callable[[dict[str, Any]], str]


def params(model: dict[str, Any]) -> str:
    return f"{format_count(model['params_total'])}/{format_count(model['params_active'])}"


def experts(model: dict[str, Any]) -> str:
    return f"{model['routed_experts']}/{model['experts_per_token']}/{model['shared_experts']}"


PUBLISHED_ROWS: list[tuple[str, Cell]] = [
    ("hub id", lambda row: row["hub_id"]),
    ("params/active", params),
    ("layers", lambda row: str(row["layers"])),
    ("hidden", lambda row: str(row["hidden"])),
    ("experts", experts),
    ("attention", lambda row: row["attention"]),
    ("KV B/token BF16", lambda row: f"{row['kv_bytes_per_token']['bf16']:,}"),
    ("KV B/token FP8", lambda row: f"{row['kv_bytes_per_token']['fp8']:,}"),
    *[(f"weights {fmt.upper()} GiB", lambda row, fmt=fmt: f"{row['weight_bytes'][fmt] / 2**30:,.0f}")
      for fmt in ("bf16", "fp8", "int4", "fp8+int4")],
    ("local checkpoint", lambda row: "found" if row["local_checkpoint"] else "none"),
    ("runs here", lambda row: row["runs_here"]),
]
STAND_IN_ROWS: dict[str, list[tuple[str, Cell]]] = {   # each stand-in's rows, under its heading
    "trained_stand_in": [
        ("params/active", params),
        ("layers × hidden", lambda small: f"{small['layers']} × {small['hidden']}"),
        ("vocabulary", lambda small: f"{small['vocab']:,} BPE"),
        ("held-out bits/byte", lambda small: f"{small['heldout_bits_per_byte']:.3f}")],
    "stand_in": [
        ("params/active", params),
        ("layers × hidden", lambda small: f"{small['layers']} × {small['hidden']}"),
        ("experts", experts),
        ("context", lambda small: f"{small['context']:,}"),
        ("KV B/token BF16", lambda small: f"{small['kv_bytes_per_token']['bf16']:,}")],
}


def presets_table(rows: list[dict[str, Any]]) -> Table:
    """One column per preset (so the table fits an 80-column terminal), one row per property; then the rows of
    each stand-in, dim ("–" where a preset has none)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("", no_wrap=True)
    for row in rows:
        table.add_column(row["name"], justify="right", overflow="fold")
    for label, cell in PUBLISHED_ROWS:
        table.add_row(label, *(cell(row) for row in rows), end_section=label == PUBLISHED_ROWS[-1][0])
    for key, heading in (("trained_stand_in", "trained stand-in"), ("stand_in", "random stand-in")):
        table.add_row(Text(heading, style="bold"))
        for label, cell in STAND_IN_ROWS[key]:
            table.add_row(label, *(cell(row[key]) if row[key] else "–" for row in rows), style="dim",
                          end_section=key == "trained_stand_in" and label == STAND_IN_ROWS[key][-1][0])
    return table


def assumptions_table(rows: list[tuple[str, str]]) -> Table:
    """Label and text, without rules."""
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for label, text in rows:
        table.add_row(label, text)
    return table


def capacity_tables(scenarios: list[capacity.Scenario], inputs: dict[str, Any]) -> list[Table]:
    """The assumptions; the checkpoints and the KV pool each leaves per GPU; the tokens each KV layout fits."""
    assumptions = assumptions_table([
        ("node", f"{inputs['gpus']} × {inputs['gpu']}, {inputs['gpu_memory_mib']:,} MiB = "
                 f"{inputs['gpu_memory_gib']:.1f} GiB each"),
        ("parallelism", f"TP={inputs['tensor_parallel']}; the MLA latent is one KV head, so every GPU holds the "
                        "whole cache of every token; the weights split evenly"),
        ("budget", f"{inputs['budget_gib']} GiB per GPU for weights + KV pool "
                   f"({100 * inputs['budget_fraction']:.0f}% of the GPU), {inputs['budget_source']}"),
        ("tokens", "(budget − checkpoint / GPUs) / KV bytes per token")])

    def label(row: dict[str, Any]) -> str:
        return f"{row['model']} {row['weights']}"

    checkpoints = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("checkpoint", "params", "GiB", "published", "GiB/GPU", "KV GiB/GPU"):
        checkpoints.add_column(name, justify="left" if name == "checkpoint" else "right")
    for checkpoint in dict.fromkeys(s.checkpoint for s in scenarios):
        row = checkpoint.as_dict()
        checkpoints.add_row(label(row), format_count(row["params"]), f"{row['gib']:.1f}",
                            f"{row['published_gib']:g}", f"{row['weights_per_gpu_gib']:.1f}",
                            f"{row['kv_pool_gib']:.1f}")

    tokens = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("checkpoint", "KV layout", "B/token", "tokens", "published", "vs published"):
        tokens.add_column(name, justify="left" if name in ("checkpoint", "KV layout") else "right")
    for index, scenario in enumerate(scenarios):
        row = scenario.as_dict()
        published = row["published_tokens"]
        versus = ("fitted" if row["role"] == "fitted" else "" if row["role"] == "unpublished"
                  else f"{100 * (row['tokens'] / published - 1):+.1f}%")
        last = index + 1 < len(scenarios) and scenarios[index + 1].checkpoint != scenario.checkpoint
        tokens.add_row(label(row), row["label"], f"{row['kv_bytes_per_token']:,}", format_count(row["tokens"]),
                       format_count(published) if published else "", versus, style="" if published else "dim",
                       end_section=last)
    return [assumptions, checkpoints, tokens]


def capacity_note(scenarios: list[capacity.Scenario]) -> str:
    """The prose under the tables; every number in it is computed from the configs."""
    ratios, facts = capacity.fp8_token_ratios(scenarios), capacity.layout_facts()
    mtp, tile, values = facts["glm_mtp_layers"], facts["fp8_tile_bytes"], facts["kimi_values_per_token_layer"]
    return (f"FP8 holds {ratios['tensor']:.3f}× the BF16 tokens with one scale per tensor ({values} B per token "
            f"per layer: the published arithmetic, SGLang's and vLLM's FP8 cache), {ratios['token']:.3f}× with "
            f"nano's fp32 scale per token per layer ({values} + {facts['fp8_scale_bytes']} B), "
            f"{ratios['tile']:.3f}× with FlashMLA's scale per 128 latent values and a BF16 rope key "
            f"({tile['latent']} + {tile['scales']} + {tile['rope']} B). "
            "Sizes are computed from the configs: INT4 = routed experts at 4 bits + a bf16 scale per 32, the rest "
            f"BF16; GLM-5.2 counts its {mtp} MTP {'layer' if mtp == 1 else 'layers'}. The budget is fitted to one "
            "published figure (vs published: \"fitted\"); the other published rows are what it predicts. Dim rows: "
            "nothing published, the fitted budget's prediction (GLM-5.2: nano's cache, indexer keys on its "
            f"{facts['glm_indexer_layers']} full layers, no MTP). See docs/paged-kv.md.")


def tp_tables(plans: list[capacity.RankPlan], inputs: dict[str, Any]) -> list[Table]:
    """The assumptions; the parameters of each part, whole and per GPU; each checkpoint's bytes per GPU and the tokens
    the KV pool beside them holds."""
    tp, models = inputs["tensor_parallel"], capacity.tp_models(plans)
    experts = ", ".join(f"{m['model']} {m['experts_per_gpu']}" for m in models)
    heads = ", ".join(f"{m['model']} {m['heads_per_gpu']}" for m in models)
    kv = "; ".join(f"{m['model']} {m['kv_bytes_per_token_per_gpu']['bf16']:,} B/token BF16, "
                   f"{m['kv_bytes_per_token_per_gpu']['fp8']:,} FP8" for m in models)
    assumptions = assumptions_table([
        ("GPUs", f"{tp} × H200, {inputs['gpu_memory_mib']:,} MiB = {inputs['gpu_memory_gib']:.1f} GiB each (quoted: "
                 "as nvidia-smi reports it)"),
        ("parallelism", f"TP={tp} as nano/parallel.py splits: attention by heads ({heads} per GPU), routed experts "
                        f"whole ({experts} per GPU), shared experts and dense MLPs by rows, embed_tokens and lm_head "
                        "by vocabulary; q_a_proj, kv_a_proj_with_mqa, the layernorms, the router and the DSA indexer "
                        "replicated"),
        ("KV cache", f"replicated: every GPU caches the whole latent of every token, so a GPU's KV bytes per token "
                     f"are one device's: {kv} (FP8: nano's fp32 scale per token per layer)"),
        ("budget", f"{inputs['budget_gib']} GiB per GPU for weights + KV pool "
                   f"({100 * inputs['budget_fraction']:.0f}% of the GPU), as nano models --capacity assumes; "
                   f"{inputs['budget_source']}"),
        ("tokens", f"(budget − weights per GPU) / KV bytes per token; weights per GPU = replicated + split / {tp}")])

    parts = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    parts.add_column("parameters", no_wrap=True)
    parts.add_column("split")
    for model in models:
        parts.add_column(model["model"], justify="right")
        parts.add_column("per GPU", justify="right")
    for index, first in enumerate(models[0]["parts"]):
        cells = []
        for model in models:
            part = model["parts"][index]
            cells += [format_count(part["params"]), format_count(part["params_per_gpu"])] if part["params"] \
                else ["–", "–"]
        how = "on every GPU" if first["split"] == capacity.REPLICATED else f"by {first['split']}"
        parts.add_row(first["name"], how, *cells, end_section=index == len(models[0]["parts"]) - 1)
    parts.add_row("total", "", *[cell for model in models
                                 for cell in (format_count(model["params"]), format_count(model["params_per_gpu"]))])

    weights = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("checkpoint", "total GiB", "replicated", f"split / {tp}", "GiB/GPU", "KV GiB/GPU",
                 "tokens/GPU BF16 KV", "FP8 KV"):
        weights.add_column(name, justify="left" if name == "checkpoint" else "right")
    for model in models:
        for row in model["weights"]:
            tokens = [format_count(row["tokens_per_gpu"][dtype]) if row["fits"] else "does not fit"
                      for dtype in ("bf16", "fp8")]
            weights.add_row(f"{row['model']} {row['weights']}", f"{row['gib']:.1f}", f"{row['replicated_gib']:.1f}",
                            f"{row['split_gib_per_gpu']:.1f}", f"{row['gib_per_gpu']:.1f}",
                            f"{row['kv_pool_gib']:.1f}", *tokens, style="" if row["fits"] else "dim")
    return [assumptions, parts, weights]


def tp_node_line(tp: int) -> str:
    """The one line under the table: what TP means for the node's context capacity."""
    gpus = f"with TP={tp} the {tp} GPUs together hold" if tp > 1 else "under TP, N GPUs together hold"
    return (f"Per node: {gpus} as many tokens as ONE GPU does (each caches every token's whole latent), so the "
            "report's 686K-token figure is per GPU; hence SGLang's data-parallel attention for MLA models (DP "
            "attention: each GPU holds different requests' latents).")


def tp_note() -> str:
    """The prose under the node line; every number in it is computed from the configs."""
    even, mtp = capacity.published_even_split(), capacity.MTP_LAYERS["glm-5.2"]
    return (f"The report's {format_count(even['published_tokens'])} ({even['model']} {even['weights']}, BF16 KV) "
            f"divides the whole checkpoint by {even['tp']} GPUs ({even['even_split_gib_per_gpu']:.1f} GiB each); "
            f"nano's TP={even['tp']} keeps the replicated parts whole on every GPU ({even['gib_per_gpu']:.1f} GiB), "
            f"and the same fitted budget then holds {format_count(even['tokens_per_gpu'])} tokens. "
            "By construction from the configs: parameters, GiB, KV bytes, tokens (sized as the checkpoints of "
            "nano models --capacity: INT4 = routed experts at 4 bits + a bf16 scale per 32, the rest BF16; FP8 = "
            "128×128 block scales, BF16 embed_tokens and lm_head; the router at the format's width, though nano "
            f"holds it in fp32; GLM-5.2 counts its {mtp} MTP {'layer' if mtp == 1 else 'layers'}, split as a decoder "
            "layer, its eh_proj replicated). Quoted: the H200's memory, the report's 686K. Fitted: the budget. Dim "
            "rows: the weights alone exceed the budget.")


def print_tp_plan(tp: int, as_json: bool) -> None:
    plans, inputs = capacity.tp_plans(tp), capacity.tp_inputs(tp)
    if as_json:
        typer.echo(json.dumps({"inputs": inputs, "models": capacity.tp_models(plans),
                               "published_even_split": capacity.published_even_split(),
                               "per_node": tp_node_line(tp)}, indent=2))
        return
    for table in tp_tables(plans, inputs):
        out.print(table)
    out.print(tp_node_line(tp), markup=False)
    out.print(tp_note(), style="dim", markup=False)


def print_capacity(as_json: bool) -> None:
    scenarios, inputs = capacity.scenarios(), capacity.inputs()
    if as_json:
        checkpoints = [c.as_dict() for c in dict.fromkeys(s.checkpoint for s in scenarios)]
        typer.echo(json.dumps({"inputs": inputs, "checkpoints": checkpoints,
                               "scenarios": [s.as_dict() for s in scenarios],
                               "fp8_over_bf16_tokens": capacity.fp8_token_ratios(scenarios),
                               "layout": capacity.layout_facts()}, indent=2))
        return
    for table in capacity_tables(scenarios, inputs):
        out.print(table)
    out.print(capacity_note(scenarios), style="dim", markup=False)


def models(as_json: Annotated[bool, typer.Option("--json", help="Print the data as JSON.")] = False,
           show_capacity: Annotated[bool, typer.Option(
               "--capacity", help="Tokens of context that fit on an 8×H200 node, by weights and KV layout.")] = False,
           tp: Annotated[int | None, typer.Option(
               "--tp", metavar="N", min=1,
               help="With --capacity: the per-GPU plan on N ranks under nano's tensor / expert parallelism "
                    "(weights per GPU by part and format, KV per GPU, tokens per GPU); N must divide the attention "
                    f"heads, e.g. {capacity.TP_DEFAULT} for one 8×H200 node.")] = None,
           ) -> None:
    """List the presets: size, experts, attention, KV bytes per token, local checkpoint or stand-in.

    With --capacity: how many tokens of context fit on an 8×H200 node. With --capacity --tp N: the per-GPU plan on
    N ranks (weights per GPU, KV per GPU, tokens per GPU)."""
    if tp is not None:
        with user_errors():
            if not show_capacity:
                raise UsageError("--tp does nothing without --capacity (nano models --capacity --tp N)")
            capacity.check_tp(tp)
        print_tp_plan(tp, as_json)
        return
    if show_capacity:
        print_capacity(as_json)
        return
    with user_errors():
        rows = [describe_preset(preset) for preset in PRESETS.values()]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    out.print(presets_table(rows))
    out.print("experts: routed/top-k/shared. KV B/token: bytes of MLA cache per token over all layers (latent + "
              "rope key, plus GLM-5's indexer keys); see docs/models.md. Weights GiB: by construction from the config "
              "(FP8: 128×128 blocks, BF16 embeddings; INT4: routed experts, group 32; FP8+INT4: both resident, "
              "FP8 prefill + INT4 decode experts in one process, as --prefill-weights fp8 --decode-weights int4 "
              "holds them).\nWithout a local checkpoint a preset runs "
              "its trained stand-in where nano ships one (held-out bits/byte: measured by its training script at "
              "1,024 tokens of context, tools/train_standin.py), else its random-weight stand-in; <preset>-random "
              "always names the latter: the same architecture, larger, with random weights and a byte-level "
              "tokenizer.",
              style="dim", markup=False)
