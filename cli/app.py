"""The `nano` command line.

    nano models [--json]              the presets: size, attention, KV-cache bytes per token, local checkpoint or not
    nano models --capacity [--json]   tokens of context that fit on an 8×H200 node, recomputed from the configs
    nano chat MODEL [options]         chat with a preset, a checkpoint directory or a Hugging Face hub id
    nano fault MODEL --FAULT          break the KV bookkeeping on purpose; see what the integrity check does (fault.py)

Output conventions: the model's text goes to stdout. Everything else goes to stderr: which model is running,
timings, errors. So `nano chat MODEL -p "..." > answer.txt` captures only the answer. A mistake the user can make
(an unknown model, a bad flag value, a prompt longer than the context) ends with one line,
`error: <message>`, and exit code 1, never a traceback. Usage errors (an unknown flag, a missing argument)
are Typer's and exit with 2.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cli import options
from cli import capacity
from nano.config import ModelConfig
from nano.errors import NanoError
from nano.disagg import SplitLLM
from nano.llm import LLM
from nano.loader import resolve_model
from nano.presets import PRESETS, Preset
from nano.sampling import SamplingParams
from nano.tokenizer import IncrementalDecoder

app = typer.Typer(help="nano: a compact, readable inference engine for MLA + MoE models (Kimi K2.x, GLM-5.x).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
# tables and slash-command answers (model text is written raw); piped, 120 columns unless COLUMNS says otherwise
out = Console(highlight=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # what is running, timings, hints: one line each


# ---- errors ---------------------------------------------------------------------------------------------------
def print_error(message: str) -> None:
    typer.echo(f"error: {' '.join(message.splitlines())}", err=True)


def fail(message: str, exit_code: int = 1) -> NoReturn:
    print_error(message)
    raise typer.Exit(exit_code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn a NanoError into one `error:` line and exit 1; Ctrl-C into a quiet exit 130."""
    try:
        yield
    except NanoError as error:
        fail(str(error))
    except KeyboardInterrupt:
        typer.echo("", err=True)  # finish the line that ^C interrupted
        raise typer.Exit(130) from None


# ---- nano models ----------------------------------------------------------------------------------------------
def format_count(count: int) -> str:
    """Three significant digits: 1_026_408_232_448 -> '1.03T', 15_960_110_208 -> '16.0B', 77_430_440 -> '77.4M'."""
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            value = count / size
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f}{suffix}"
    return str(count)


def format_bytes(nbytes: float) -> str:
    """Binary units, three significant digits: 33_554_432 -> '32.0 MiB'."""
    for suffix, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f} {suffix}"
    return f"{nbytes:.0f} B"


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
        "weight_bytes": {fmt.lower(): capacity.weight_bytes(real, fmt) for fmt in ("BF16", "FP8", "INT4")},
        "local_checkpoint": str(resolved.path) if resolved.kind == "checkpoint" else None,
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
          for fmt in ("bf16", "fp8", "int4")],
        ("local checkpoint", lambda row: "found" if row["local_checkpoint"] else "none"),
    ]
    for label, cell in published:
        table.add_row(label, *(cell(row) for row in rows), end_section=label == published[-1][0])
    table.add_row(Text("nano stand-in", style="bold"))
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
                                  f"({100 * inputs['budget_fraction']:.0f}% of the GPU)")
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
    for name in ("checkpoint", "KV layout", "B/token", "tokens", "published"):
        tokens.add_column(name, justify="left" if name in ("checkpoint", "KV layout") else "right")
    for scenario in scenarios:
        row = scenario.as_dict()
        published = row["published_tokens"]
        tokens.add_row(label(row), row["kv_layout"], f"{row['kv_bytes_per_token']:,}", format_count(row["tokens"]),
                       format_count(published) if published else "", style="" if published else "dim")
    return [assumptions, checkpoints, tokens]


def print_capacity(as_json: bool) -> None:
    scenarios, inputs = capacity.scenarios(), capacity.inputs()
    if as_json:
        checkpoints = [c.as_dict() for c in dict.fromkeys(s.checkpoint for s in scenarios)]
        typer.echo(json.dumps({"inputs": inputs, "checkpoints": checkpoints,
                               "scenarios": [s.as_dict() for s in scenarios],
                               "fp8_over_bf16_tokens": capacity.fp8_token_ratios(scenarios)}, indent=2))
        return
    for table in capacity_tables(scenarios, inputs):
        out.print(table)
    ratios = capacity.fp8_token_ratios(scenarios)
    out.print(f"FP8 holds {ratios['per_tensor']:.3f}× the BF16 tokens with one scale per tensor, "
              f"{ratios['nano']:.3f}× with nano's fp32 scale per token per layer (576 + 4 B). "
              "Sizes are computed from the configs: INT4 = routed experts at 4 bits + a bf16 scale per 32, the rest "
              "BF16; GLM-5.2 counts its MTP layer. Dim rows: nano's own layout (GLM-5.2: indexer keys on its 21 "
              "full layers, no MTP). See docs/paged-kv.md.", style="dim", markup=False)


@app.command()
def models(as_json: Annotated[bool, typer.Option("--json", help="Print the data as JSON.")] = False,
           show_capacity: Annotated[bool, typer.Option(
               "--capacity", help="Tokens of context that fit on an 8×H200 node, by weights and KV layout.")] = False,
           ) -> None:
    """List the presets: size, experts, attention, KV-cache bytes per token, local checkpoint or stand-in. With
    --capacity: how many tokens of context fit on an 8×H200 node."""
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
              "rope key, plus GLM-5's indexer keys); see docs/models.md.\nWithout a local checkpoint a preset runs "
              "its nano stand-in: the same architecture, smaller, with random weights and a byte-level tokenizer.",
              style="dim", markup=False)


# ---- nano chat ------------------------------------------------------------------------------------------------
# Random bytes from a stand-in model may be terminal control codes; shown as \xNN they cannot move the cursor.
_CONTROL_ESCAPES = {code: f"\\x{code:02x}" for code in [*range(0x20), *range(0x7F, 0xA0)]
                    if chr(code) not in "\n\t"}


def terminal_safe(text: str) -> str:
    return text.translate(_CONTROL_ESCAPES)


def write_model_text(text: str) -> None:
    """Stream model output to stdout as it arrives, escaping control characters when stdout is a terminal."""
    sys.stdout.write(terminal_safe(text) if sys.stdout.isatty() else text)
    sys.stdout.flush()


@dataclass
class Reply:
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill_s: float     # prompt submitted -> first token
    decode_s: float      # first token -> last token

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def generation_tokens_per_s(self) -> float:
        steps = len(self.token_ids) - 1  # the first token comes out of the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def summary(self) -> str:
        return (f"prompt: {self.prompt_tokens} tokens, {self.prompt_tokens_per_s:.1f} tok/s, TTFT "
                f"{1e3 * self.prefill_s:.0f} ms · generation: {len(self.token_ids)} tokens, "
                f"{self.generation_tokens_per_s:.1f} tok/s")

    def timings(self) -> dict[str, float]:
        return {"prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
                "total_s": round(self.prefill_s + self.decode_s, 6),
                "prompt_tokens_per_s": round(self.prompt_tokens_per_s, 3),
                "generation_tokens_per_s": round(self.generation_tokens_per_s, 3)}


class Conversation:
    """A multi-turn chat: every reply renders the whole conversation through the model's chat template."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None) -> None:
        self.llm, self.params = llm, params
        self.opening = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.opening)
        self.last_reply: Reply | None = None
        self.context_used = 0
        self.replies = self.total_prompt_tokens = self.total_completion_tokens = 0

    def reset(self) -> None:
        self.messages = list(self.opening)
        self.context_used = 0

    def set_system(self, system: str | None) -> None:
        """A new system message starts a new conversation with it."""
        self.opening = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reply(self, user_text: str, on_text: Callable[[str], None] | None = None) -> Reply:
        """Generate the assistant's answer to `user_text`, passing text to `on_text` as it is produced. The turn
        joins the conversation only when the reply completes: an error or Ctrl-C leaves the conversation as it
        was."""
        messages = [*self.messages, {"role": "user", "content": user_text}]
        prompt_ids = self.llm.tokenizer.encode_chat(messages)
        decoder = IncrementalDecoder(self.llm.tokenizer)
        token_ids: list[int] = []
        started = first_token_at = time.perf_counter()
        for token_id in self.llm.stream(prompt_ids, self.params):
            if not token_ids:
                first_token_at = time.perf_counter()
            token_ids.append(token_id)
            if on_text:  # one token behind: the newest may be the stop token, which is not part of the text
                on_text(decoder.step(token_ids[:-1]))
        finished = time.perf_counter()
        output = self.llm.last_output
        if on_text:
            text_ids = token_ids[:-1] if output.finish_reason == "stop" else token_ids
            on_text(decoder.step(text_ids) + decoder.flush())
        if output.finish_reason == "abort":  # the KV pool cannot hold the conversation
            if on_text and token_ids:
                on_text("\n")  # end the partial reply's line before the error
            raise NanoError(f"{output.error}; a larger --kv-budget holds more tokens")
        reply = Reply(len(prompt_ids), output.token_ids, output.text, output.finish_reason,
                      first_token_at - started, finished - first_token_at)
        self.messages = [*messages, {"role": "assistant", "content": reply.text}]
        self.last_reply = reply
        self.context_used = reply.prompt_tokens + len(reply.token_ids)
        self.replies += 1
        self.total_prompt_tokens += reply.prompt_tokens
        self.total_completion_tokens += len(reply.token_ids)
        return reply

    def stats(self) -> str:
        last = self.last_reply.summary() if self.last_reply else "none yet"
        used, limit = self.context_used, self.llm.max_context
        if isinstance(self.llm, SplitLLM):
            info, moved = self.llm.info, self.llm.stats
            return (f"last reply: {last}\n"
                    f"context:    {used:,} / {limit:,} tokens ({100 * used / limit:.1f}%)\n" + "".join(
                        f"{role + ':':11} pid {info[role]['pid']}, weights {info[role]['weights']}, KV "
                        f"{info[role]['kv_dtype']}\n" for role in ("prefill", "decode"))
                    + f"transfers:  {moved.transfers:,}, {format_bytes(moved.bytes)} of KV, "
                      f"{moved.gb_per_s:.3f} GB/s (pack + checksum + convert)")
        pool, engine = self.llm.pool, self.llm.engine
        free = engine.scheduler.allocator.num_free
        held = self.llm.last_request.final_page_table if self.llm.last_request else []
        return (f"last reply: {last}\n"
                f"session:    {self.replies} {'reply' if self.replies == 1 else 'replies'}, "
                f"{self.total_prompt_tokens:,} prompt tokens, {self.total_completion_tokens:,} generated tokens\n"
                f"context:    {used:,} / {limit:,} tokens ({100 * used / limit:.1f}%)\n"
                f"KV pool:    {pool.kv_dtype}, {pool.page_size}-token pages: {pool.num_pages - free:,} used "
                f"(peak {engine.scheduler.stats.peak_pages_used:,}), {free:,} free, {pool.num_pages:,} total; "
                f"{format_bytes(pool.nbytes)} for {pool.tokens:,} tokens\n"
                f"KV held:    {len(held)} {'page' if len(held) == 1 else 'pages'} = "
                f"{format_bytes(len(held) * pool.nbytes / pool.num_pages)} by the last reply as it finished "
                f"(/pages lists them)\n"
                f"engine:     {engine.stats.steps:,} steps, {engine.scheduler.stats.preemptions:,} preemptions, "
                f"peak {engine.scheduler.stats.peak_running:,} running\n"
                f"weights:    prefill {self.llm.prefill_weights}, decode {self.llm.decode_weights}; resident "
                + ", ".join(f"{fmt} {format_bytes(size)}" for fmt, size in sorted(self.llm.weight_bytes().items())))


SLASH_HELP = """\
/help               show this list
/reset              start a new conversation (the system message stays)
/stats              speed of the last reply (TTFT, tokens/s), session totals, context used / max, KV pool
                    (pages, bytes) and engine counters
/pages              the KV pages the last reply used: logical page -> physical page, integrity tag, tokens
/set                show the sampling settings
/set NAME VALUE     change one: temperature, top_p, top_k, max_tokens, seed (seed none: unseeded)
/system [TEXT]      show the system message, or set it and start a new conversation (/system none: remove)
\"\"\"                 on a line of its own: start multi-line input; another \"\"\" line sends it
/exit               quit (so do Ctrl-D and end of input)"""
SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "seed": int}


def set_parameter(conversation: Conversation, words: list[str]) -> None:
    """/set NAME VALUE: one sampling setting, checked by SamplingParams; /set alone shows them."""
    params = conversation.params
    if not words:
        out.print(" · ".join(f"{name} {getattr(params, name)}" for name in SETTABLE), markup=False)
        return
    if len(words) != 2 or words[0] not in SETTABLE:
        raise NanoError(f"usage: /set NAME VALUE with NAME one of {', '.join(SETTABLE)}")
    name, text = words
    try:
        value = None if name == "seed" and text == "none" else SETTABLE[name](text)
    except ValueError:
        raise NanoError(f"/set {name}: {text!r} is not a{'n integer' if SETTABLE[name] is int else ' number'}"
                        ) from None
    conversation.params = dataclasses.replace(params, **{name: value})
    out.print(f"{name} = {value}", markup=False)


def show_pages(llm: LLM | SplitLLM) -> None:
    """The page table of the last reply's request as it finished: which physical page holds which tokens."""
    if isinstance(llm, SplitLLM):
        out.print("with --disagg the KV pages live in the decode worker's pool; /pages shows single-process runs",
                  markup=False)
        return
    request = llm.last_request
    if request is None:
        out.print("no reply yet: /pages shows the KV pages of the last reply", markup=False)
        return
    pages, size, cached = request.final_page_table, llm.pool.page_size, request.num_cached
    if not pages:  # aborted (the pool was too small, or the reply was interrupted): it gave its pages back
        out.print(f"request {request.request_id} holds no KV pages: {request.error}", markup=False, soft_wrap=True)
        return
    out.print(f"request {request.request_id}: {cached:,} tokens cached in {len(pages)} "
              f"{'page' if len(pages) == 1 else 'pages'} of {size} tokens", markup=False)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    tags = request.final_page_tags or [None] * len(pages)   # no tags with integrity off
    for name in ("page", "physical", "tag", "tokens", "filled"):
        table.add_column(name, justify="right")
    for index, (physical, tag) in enumerate(zip(pages, tags)):
        first, last = index * size, min((index + 1) * size, cached) - 1
        table.add_row(str(index), str(physical), "–" if tag is None else str(tag), f"{first}–{last}",
                      f"{last - first + 1}/{size}")
    out.print(table)
    out.print("nano frees a request's pages when it finishes (there is no prefix cache yet): these pages are free "
              "again, and the next turn computes the whole conversation anew", style="dim", markup=False)


def run_slash_command(command: str, conversation: Conversation) -> bool:
    """Carry out one slash command; returns False when the session should end."""
    words = command.split()
    match words[0]:
        case "/exit":
            return False
        case "/help":
            out.print(SLASH_HELP, markup=False, soft_wrap=True)
        case "/reset":
            conversation.reset()
            out.print("conversation cleared", markup=False)
        case "/stats":
            out.print(conversation.stats(), markup=False, soft_wrap=True)
        case "/pages":
            show_pages(conversation.llm)
        case "/set":
            try:
                set_parameter(conversation, words[1:])
            except NanoError as error:
                print_error(str(error))
        case "/system":
            text = command.partition(" ")[2].strip()
            if not text:
                current = conversation.opening[0]["content"] if conversation.opening else "(none)"
                out.print(f"system: {current}", markup=False, soft_wrap=True)
            else:
                conversation.set_system(None if text == "none" else text)
                out.print("system message " + ("removed" if text == "none" else "set") + "; conversation cleared",
                          markup=False)
        case unknown:
            print_error(f"unknown command {unknown}; /help lists the commands")
    return True


def chat_loop(conversation: Conversation) -> None:
    """Read turns until /exit or end of input. On a terminal: a `>>> ` prompt, and an error or Ctrl-C during
    a reply only ends that reply. With stdin piped, each line is a turn and the first error ends the run."""
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (gives input() line editing and history)
        err.print("Type a message. /help lists the commands; /exit or Ctrl-D quits.", style="dim")
    while True:
        try:
            line = input(">>> " if interactive else "").strip()
        except EOFError:
            if interactive:
                write_model_text("\n")
            return
        if not line:
            continue
        if line == '"""':   # multi-line input: every line up to the next """ line is one message
            lines = []
            try:
                while (part := input("... " if interactive else "")).strip() != '"""':
                    lines.append(part)
            except EOFError:
                pass
            line = "\n".join(lines).strip()
            if not line:
                continue
        elif line.startswith("/"):
            if not run_slash_command(line, conversation):
                return
            continue
        try:
            reply = conversation.reply(line, write_model_text)
        except NanoError as error:
            if not interactive:
                raise
            print_error(str(error))
            continue
        except KeyboardInterrupt:
            if not interactive:
                raise
            write_model_text("\n")
            err.print("(reply interrupted; it is not part of the conversation)", style="dim")
            continue
        write_model_text("\n")
        err.print(reply.summary(), style="dim", markup=False)


@app.command()
def chat(
    model: options.Model,
    weights: options.Weights = "auto",
    prefill_weights: options.PrefillWeights = None,
    decode_weights: options.DecodeWeights = None,
    int4_all: options.Int4All = False,
    prompt: Annotated[str | None, typer.Option(
        "--prompt", "-p", metavar="TEXT", help="Answer this one message, then exit.")] = None,
    system: Annotated[str | None, typer.Option(
        metavar="TEXT", help="System message that opens the conversation.")] = None,
    max_tokens: Annotated[int, typer.Option(metavar="N", help="Most tokens in one reply.")] = 256,
    temperature: Annotated[float, typer.Option(metavar="F", help="Sampling temperature; 0 is greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option(metavar="F", help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(metavar="N", help="Sample from the k most likely tokens; 0 is off.")] = 0,
    seed: Annotated[int | None, typer.Option(metavar="N", help="Sampling seed, for repeatable replies.")] = None,
    dtype: options.Dtype = None,
    kv_dtype: options.KvDtype = "auto",
    kv_budget: options.KvBudget = None,
    page_size: options.PageSize = 64,
    max_running: options.MaxRunning = 256,
    integrity: options.Integrity = True,
    as_json: Annotated[bool, typer.Option(
        "--json", help="With -p: print one JSON object (text, token ids, counts, timings).")] = False,
    disagg: options.Disagg = False,
    prefill_kv_dtype: options.PrefillKvDtype = "bf16",
    decode_kv_dtype: options.DecodeKvDtype = "fp8",
    transport: options.Transport = "shm",
) -> None:
    """Chat with a model. Interactive by default (slash commands: /help /reset /stats /pages /set /system /exit;
    a line of \"\"\" starts and ends multi-line input); one reply with -p."""
    if as_json and prompt is None:
        fail("--json needs -p/--prompt (it prints one reply as one JSON object)", exit_code=2)
    with user_errors():
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                max_tokens=max_tokens)
        engine = options.EngineOptions(
            weights=weights, prefill_weights=prefill_weights, decode_weights=decode_weights, int4_all=int4_all,
            dtype=dtype.value if dtype else None, kv_dtype=kv_dtype, kv_budget=kv_budget, page_size=page_size,
            max_running=max_running, integrity=integrity, disagg=disagg, prefill_kv_dtype=prefill_kv_dtype,
            decode_kv_dtype=decode_kv_dtype, transport=transport)
        llm = engine.build(model, progress=sys.stderr.isatty())
        try:
            converse(llm, model, params, system, prompt, as_json)
        finally:
            if disagg:
                llm.close()


def converse(llm: LLM | SplitLLM, model: str, params: SamplingParams, system: str | None, prompt: str | None,
             as_json: bool) -> None:
    """The chat session proper: interactive, or one reply (as text or as JSON)."""
    err.print(llm.label + (f" · split: prefill pid {llm.info['prefill']['pid']}, decode pid "
                           f"{llm.info['decode']['pid']}" if isinstance(llm, SplitLLM) else ""),
              style="bold", markup=False)
    conversation = Conversation(llm, params, system)
    if prompt is None:
        chat_loop(conversation)
    elif as_json:
        reply = conversation.reply(prompt)
        typer.echo(json.dumps({
            "model": model, "label": llm.label, "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": len(reply.token_ids), "text": reply.text, "token_ids": reply.token_ids,
            "finish_reason": reply.finish_reason, "timings": reply.timings(),
        }, ensure_ascii=False))
    else:
        reply = conversation.reply(prompt, write_model_text)
        write_model_text("\n")
        err.print(reply.summary(), style="dim", markup=False)


from cli import bench as _bench, fault as _fault, profile as _profile  # noqa: E402,F401  (register their commands)


def main() -> None:
    app(prog_name="nano")


if __name__ == "__main__":
    main()
