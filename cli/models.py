"""`nano models`: the presets (size, experts, attention, KV bytes per token, local checkpoint or stand-in), and
with `--capacity` the tokens of context that fit on an 8×H200 node (the arithmetic is in capacity.py)."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from nano.config import ModelConfig
from nano.loader import STANDINS, read_config, resolve_model, trained_record
from nano.presets import PRESETS, Preset

from . import capacity
from .console import format_count, out, user_errors


def describe_preset(preset: Preset) -> dict[str, Any]:
    """One preset as plain data: the published model's numbers, its nano stand-in, and what runs here."""
    real, stand_in = ModelConfig.from_hf(preset.config), ModelConfig.from_hf(preset.nano_config)
    resolved = resolve_model(preset.name)
    return {
        "name": preset.name,
        "hub_id": preset.hub_id,
        "params_total": real.num_parameters(),
        "params_active": real.num_parameters(active_only=True),
        "layers": real.num_hidden_layers,
        "hidden": real.hidden_size,
        "routed_experts": real.n_routed_experts,
        "experts_per_token": real.num_experts_per_tok,
        "shared_experts": real.n_shared_experts,
        "attention": "MLA+DSA" if real.has_indexer else "MLA",
        "kv_bytes_per_token": {"bf16": real.kv_bytes_per_token("bf16"),
                               "fp8": real.kv_bytes_per_token("fp8", token_scales=False)},
        "weight_bytes": {fmt.lower(): capacity.weight_bytes(real, fmt) for fmt in ("BF16", "FP8", "INT4", "FP8+INT4")},
        "local_checkpoint": str(resolved.path) if resolved.kind == "checkpoint" else None,
        "runs_here": {"checkpoint": "checkpoint", "trained": "trained stand-in", "nano": "random stand-in"}[
            resolved.kind],
        "trained_stand_in": trained_stand_in(preset.name),
        "stand_in": {
            "params_total": stand_in.num_parameters(),
            "params_active": stand_in.num_parameters(active_only=True),
            "layers": stand_in.num_hidden_layers,
            "hidden": stand_in.hidden_size,
            "routed_experts": stand_in.n_routed_experts,
            "experts_per_token": stand_in.num_experts_per_tok,
            "shared_experts": stand_in.n_shared_experts,
            "context": stand_in.max_position_embeddings,
            "kv_bytes_per_token": {"bf16": stand_in.kv_bytes_per_token("bf16"),
                                   "fp8": stand_in.kv_bytes_per_token("fp8", token_scales=False)},
        },
    }


def trained_stand_in(name: str) -> dict[str, Any] | None:
    """The shipped trained stand-in of a preset: its size and held-out bits per byte (as its training measured)."""
    record = trained_record(name)
    if record is None:
        return None
    config = ModelConfig.from_hf(read_config(STANDINS / name))
    heldout = record["heldout_figures"]["heldout_1024"]
    return {"params_total": record["parameters"], "params_active": config.num_parameters(active_only=True),
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size,
            "trained_on": record["trained_on"], "heldout_bits_per_byte": heldout["bits_per_byte"],
            "heldout_context": heldout["context"]}


def presets_table(rows: list[dict[str, Any]]) -> Table:
    """One column per preset (so the table fits an 80-column terminal), one row per property."""
    def params(model: dict[str, Any]) -> str:
        return f"{format_count(model['params_total'])}/{format_count(model['params_active'])}"

    def experts(model: dict[str, Any]) -> str:
        return f"{model['routed_experts']}/{model['experts_per_token']}/{model['shared_experts']}"

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("", no_wrap=True)
    for row in rows:
        table.add_column(row["name"], justify="right", overflow="fold")
    published: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
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
    for label, cell in published:
        table.add_row(label, *(cell(row) for row in rows), end_section=label == published[-1][0])
    table.add_row(Text("trained stand-in", style="bold"))
    trained: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("params/active", params),
        ("layers × hidden", lambda small: f"{small['layers']} × {small['hidden']}"),
        ("vocabulary", lambda small: f"{small['vocab']:,} BPE"),
        ("held-out bits/byte", lambda small: f"{small['heldout_bits_per_byte']:.3f}"),
    ]
    for label, cell in trained:
        table.add_row(label, *(cell(row["trained_stand_in"]) if row["trained_stand_in"] else "–" for row in rows),
                      style="dim", end_section=label == trained[-1][0])
    table.add_row(Text("random stand-in", style="bold"))
    stand_in: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("params/active", params),
        ("layers × hidden", lambda small: f"{small['layers']} × {small['hidden']}"),
        ("experts", experts),
        ("context", lambda small: f"{small['context']:,}"),
        ("KV B/token BF16", lambda small: f"{small['kv_bytes_per_token']['bf16']:,}"),
    ]
    for label, cell in stand_in:
        table.add_row(label, *(cell(row["stand_in"]) for row in rows), style="dim")
    return table


def capacity_tables(scenarios: list[capacity.Scenario], inputs: dict[str, Any]) -> list[Table]:
    """The assumptions; the checkpoints and the KV pool each leaves per GPU; the tokens each KV layout fits."""
    assumptions = Table(box=None, show_header=False, pad_edge=False)
    assumptions.add_column(style="bold", no_wrap=True)
    assumptions.add_column()
    assumptions.add_row("node", f"{inputs['gpus']} × {inputs['gpu']}, {inputs['gpu_memory_mib']:,} MiB = "
                                f"{inputs['gpu_memory_gib']:.1f} GiB each")
    assumptions.add_row("parallelism", f"TP={inputs['tensor_parallel']}; the MLA latent is one KV head, so every "
                                       "GPU holds the whole cache of every token; the weights split evenly")
    assumptions.add_row("budget", f"{inputs['budget_gib']} GiB per GPU for weights + KV pool "
                                  f"({100 * inputs['budget_fraction']:.0f}% of the GPU), {inputs['budget_source']}")
    assumptions.add_row("tokens", "(budget − checkpoint / GPUs) / KV bytes per token")

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
    for scenario in scenarios:
        row = scenario.as_dict()
        published = row["published_tokens"]
        versus = ("fitted" if row["role"] == "fitted" else "" if row["role"] == "nano"
                  else f"{100 * (row['tokens'] / published - 1):+.1f}%")
        tokens.add_row(label(row), row["kv_layout"], f"{row['kv_bytes_per_token']:,}", format_count(row["tokens"]),
                       format_count(published) if published else "", versus, style="" if published else "dim")
    return [assumptions, checkpoints, tokens]


def capacity_note(scenarios: list[capacity.Scenario]) -> str:
    """The prose under the tables; every number in it is computed from the configs."""
    ratios, facts = capacity.fp8_token_ratios(scenarios), capacity.layout_facts()
    mtp = facts["glm_mtp_layers"]
    return (f"FP8 holds {ratios['per_tensor']:.3f}× the BF16 tokens with one scale per tensor, "
            f"{ratios['nano']:.3f}× with nano's fp32 scale per token per layer "
            f"({facts['kimi_values_per_token_layer']} + {facts['fp8_scale_bytes']} B). "
            "Sizes are computed from the configs: INT4 = routed experts at 4 bits + a bf16 scale per 32, the rest "
            f"BF16; GLM-5.2 counts its {mtp} MTP {'layer' if mtp == 1 else 'layers'}. The budget is fitted to one "
            "published figure (vs published: \"fitted\"); the other published rows are what it predicts. Dim rows: "
            f"nano's own layout (GLM-5.2: indexer keys on its {facts['glm_indexer_layers']} full layers, no MTP). "
            "See docs/paged-kv.md.")


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
           ) -> None:
    """List the presets: size, experts, attention, KV bytes per token, local checkpoint or stand-in.

    With --capacity: how many tokens of context fit on an 8×H200 node."""
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
