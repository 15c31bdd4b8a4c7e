"""`nano chat MODEL`: an interactive, multi-turn chat with slash commands, or one reply with `-p` (as text or JSON).

The model's text streams to stdout as it is generated (control characters escaped on a terminal); the model
line, the speed of each reply and errors go to stderr.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from nano.errors import NanoError
from nano.tokenizer import utf8_text

if TYPE_CHECKING:   # the engine (torch) loads once the command line is checked
    from nano.disagg import SplitLLM
    from nano.llm import LLM, RequestOutput
    from nano.sampling import SamplingParams

from .console import UsageError, err, format_bytes, out, print_error, user_errors, warn
from .options import SEED_RANGE, EngineOptions, Model, engine_flags, typed_flags


# Random bytes from a stand-in model may be terminal control codes; shown as \xNN they cannot move the cursor.
_CONTROL_ESCAPES = {code: f"\\x{code:02x}" for code in [*range(0x20), *range(0x7F, 0xA0)]
                    if chr(code) not in "\n\t"}


def terminal_safe(text: str) -> str:
    return text.translate(_CONTROL_ESCAPES)


def write_model_text(text: str) -> None:
    """Stream model output to stdout as it arrives, escaping control characters when stdout is a terminal."""
    sys.stdout.write(terminal_safe(text) if sys.stdout.isatty() else text)
    sys.stdout.flush()


def summary(output: RequestOutput) -> str:
    """One reply's speed, from the engine's latencies (`nano.scheduler.latency_metrics`): the prompt's tokens per
    second of prefill (TTFT), then the generated tokens per second after the first (which comes out of the prefill)."""
    metrics, prompt = output.metrics, len(output.prompt_token_ids)
    ttft, tpot, cached = metrics.get("ttft_s", 0.0), metrics.get("tpot_s"), metrics.get("cached_tokens", 0)
    return (f"prompt: {prompt} tokens{f' ({cached} from the prefix cache)' if cached else ''}, "
            f"{prompt / ttft if ttft > 0 else 0.0:.1f} tok/s, TTFT {1e3 * ttft:.0f} ms · generation: "
            f"{len(output.token_ids)} tokens, {1 / tpot if tpot else 0.0:.1f} tok/s")


def reply_json(model: str, label: str, output: RequestOutput) -> str:
    """One reply as `nano chat -p --json` prints it."""
    metrics, prompt = output.metrics, len(output.prompt_token_ids)
    ttft, e2e, tpot = metrics.get("ttft_s", 0.0), metrics.get("e2e_s", 0.0), metrics.get("tpot_s")
    timings = {"prefill_s": round(ttft, 6), "decode_s": round(e2e - ttft, 6), "total_s": round(e2e, 6),
               "ttft_s": round(ttft, 6), "tpot_s": None if tpot is None else round(tpot, 6),
               "prompt_tokens_per_s": round(prompt / ttft if ttft > 0 else 0.0, 3),
               "generation_tokens_per_s": round(1 / tpot if tpot else 0.0, 3)}
    return json.dumps({"model": model, "label": label, "prompt_tokens": prompt,
                       "completion_tokens": len(output.token_ids), "text": output.text,
                       "token_ids": output.token_ids, "finish_reason": output.finish_reason, "timings": timings},
                      ensure_ascii=False)


class Conversation:
    """A multi-turn chat: every reply renders the whole conversation through the model's chat template."""

    def __init__(self, llm: LLM | SplitLLM, params: SamplingParams, system: str | None,
                 max_tokens_given: bool) -> None:
        """`max_tokens_given`: params.max_tokens was asked for; otherwise it is a default that each reply lowers to
        the room the conversation leaves (LLM.max_request_tokens)."""
        self.llm, self.params, self.max_tokens_given = llm, params, max_tokens_given
        self.opening = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.opening)
        self.last_reply: RequestOutput | None = None
        self.context_used = 0
        self.replies = self.total_prompt_tokens = self.total_completion_tokens = 0

    def reset(self) -> None:
        self.messages = list(self.opening)
        self.context_used = 0

    def set_system(self, system: str | None) -> None:
        """A new system message starts a new conversation with it."""
        self.opening = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reply(self, user_text: str, on_text: Callable[[str], None] | None = None) -> RequestOutput:
        """Generate the assistant's answer to `user_text`, passing text to `on_text` as it is produced. The turn
        joins the conversation only when the reply completes: an error or Ctrl-C leaves the conversation as it
        was. Without a seed, each reply draws with a fresh one."""
        messages = [*self.messages, {"role": "user", "content": user_text}]
        prompt_ids = self.llm.tokenizer.encode_chat(messages)
        self.refuse_unless_fits(len(prompt_ids))
        params, room = self.params.seeded(), self.llm.max_request_tokens - len(prompt_ids)
        if not self.max_tokens_given:   # at least 1: refused above otherwise
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        shown = ""
        for output in self.llm.stream(prompt_ids, params):
            if on_text:
                on_text(output.text[len(shown):])
            shown = output.text
        if output.finish_reason == "abort":
            if on_text and output.token_ids:
                on_text("\n")  # end the partial reply's line before the error
            raise NanoError(output.error)
        self.messages = [*messages, {"role": "assistant", "content": output.text}]
        self.last_reply = output
        self.context_used = len(output.prompt_token_ids) + len(output.token_ids)
        self.replies += 1
        self.total_prompt_tokens += len(output.prompt_token_ids)
        self.total_completion_tokens += len(output.token_ids)
        return output

    def refuse_unless_fits(self, prompt_tokens: int) -> None:
        """A NanoError, as the server's for a request that does not fit, unless the next reply (a prompt of
        `prompt_tokens`, then max_tokens if given, else at least one token) fits one request; it says what helps:
        a conversation that outgrew the KV pool or the context fails the same way at every message until /reset."""
        from nano.llm import check_request_fits   # here: the CLI starts without loading torch

        llm, given = self.llm, self.params.max_tokens if self.max_tokens_given else None
        try:
            check_request_fits(prompt_tokens, given, llm.max_request_tokens, llm.max_context)
        except NanoError as error:
            room, started = llm.max_request_tokens - prompt_tokens, self.messages != self.opening
            if given and room >= 1:
                fix = f"/set max_tokens {room} or less" + (", or /reset to start a new conversation" if started else "")
            elif started:
                fix = "the conversation has outgrown it: every message fails the same way until /reset starts a new one"
            else:
                pool_bound = llm.max_request_tokens < llm.max_context
                fix = "use a shorter message" + (" or a bigger --kv-budget" if pool_bound else "")
            raise NanoError(f"{error}: {fix}") from None

    def outgrowing(self) -> str:
        """A warning line once the conversation holds more than 80% of what one request may hold, else ''."""
        limit = self.llm.max_request_tokens
        if self.context_used <= 0.8 * limit:
            return ""
        holds = "the model's context" if limit >= self.llm.max_context else "the KV pool"
        return (f"\nwarning:    the conversation fills {100 * self.context_used / limit:.1f}% of the {limit:,} tokens "
                f"one request may hold ({holds}); once it outgrows them, every message fails until /reset")

    def stats(self) -> str:
        from nano.disagg import SplitLLM
        last = summary(self.last_reply) if self.last_reply else "none yet"
        used, limit = self.context_used, self.llm.max_context
        if isinstance(self.llm, SplitLLM):
            info, moved = self.llm.info, self.llm.stats
            return (f"last reply: {last}\n"
                    f"context:    {used:,} / {limit:,} tokens ({100 * used / limit:.1f}%)\n" + "".join(
                        f"{role + ':':11} pid {info[role]['pid']}, weights {info[role]['weights']} (resident "
                        f"{resident(info[role]['weight_bytes'])}), KV {info[role]['kv_dtype']}\n"
                        for role in ("prefill", "decode"))
                    + f"transfers:  {moved.transfers:,}, {format_bytes(moved.bytes)} of KV, "
                      f"{moved.gb_per_s:.3f} GB/s (pack + checksum + convert)" + self.outgrowing())
        pool, counters = self.llm.pool, self.llm.counters()
        free, cached = counters["free_pages"], counters["cached_pages"]
        held = self.llm.last_request.page_table if self.llm.last_request else []
        looked_up = counters["lookup_tokens"]
        prefix = (f"on · {counters['cached_tokens']:,} of {looked_up:,} prompt tokens this session came from it "
                  f"({100 * counters['cached_tokens'] / looked_up:.1f}% hit rate), {cached:,} "
                  f"page{'s' * (cached != 1)} cached" if looked_up else "on · nothing looked up yet") \
            if counters["prefix_cache"] else "off (--no-prefix-cache)"
        return (f"last reply: {last}\n"
                f"session:    {self.replies} {'reply' if self.replies == 1 else 'replies'}, "
                f"{self.total_prompt_tokens:,} prompt tokens, {self.total_completion_tokens:,} generated tokens\n"
                f"context:    {used:,} / {limit:,} tokens ({100 * used / limit:.1f}%)\n"
                f"KV pool:    {pool.format}, {pool.page_size}-token pages: {pool.num_pages - free:,} used "
                f"(peak {counters['peak_pages_used']:,}), {free:,} free, {pool.num_pages:,} total; "
                f"{format_bytes(pool.nbytes)} for {pool.tokens:,} tokens\n"
                f"KV held:    {len(held)} {'page' if len(held) == 1 else 'pages'} = "
                f"{format_bytes(len(held) * pool.nbytes / pool.num_pages)} by the last reply as it finished "
                f"(/pages lists them)\n"
                f"prefix cache: {prefix}\n"
                f"engine:     {counters['steps']:,} steps, {counters['preemptions']:,} preemptions, "
                f"peak {counters['peak_running']:,} running\n"
                f"weights:    prefill {self.llm.prefill_weights}, decode {self.llm.decode_weights}; resident "
                f"{resident(self.llm.weight_bytes())}"
                + (" (bfloat16 values held and multiplied in float32: this CPU has no bf16 matmul)"
                   if self.llm.compute_dtype != self.llm.dtype else "")
                + (f" on rank 0 of {self.llm.group.world} (each rank holds its own part and its own KV pool)"
                   if self.llm.group else "") + self.outgrowing())


def resident(weight_bytes: dict[str, int]) -> str:
    """Resident weight bytes by storage format, e.g. "fp32 1.2 MiB, fp8 40.0 MiB"."""
    return ", ".join(f"{fmt} {format_bytes(size)}" for fmt, size in sorted(weight_bytes.items()))


SLASH_HELP = """\
/help               show this list
/reset              start a new conversation (the system message stays)
/stats              speed of the last reply (TTFT, tokens/s), session totals, context used / max, KV pool
                    (pages, bytes), prefix cache (cached tokens, hit rate) and engine counters
/pages              the KV pages the last reply used: logical page -> physical page, integrity tag, tokens
/set                show the sampling settings
/set NAME VALUE     change one: temperature, top_p, top_k, max_tokens, seed (seed none: a fresh one per reply)
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
    conversation.max_tokens_given |= name == "max_tokens"
    out.print(f"{name} = {value}", markup=False)


def show_pages(llm: LLM | SplitLLM) -> None:
    """The page table of the last reply's request as it finished: which physical page holds which tokens."""
    from nano.disagg import SplitLLM
    if isinstance(llm, SplitLLM):
        out.print("with --disagg the KV pages live in the decode worker's pool; /pages shows single-process runs",
                  markup=False)
        return
    request = llm.last_request
    if request is None:
        out.print("no reply yet: /pages shows the KV pages of the last reply", markup=False)
        return
    pages, size, cached = request.page_table, llm.pool.page_size, request.num_cached
    if not pages:  # aborted (the pool was too small, or the reply was interrupted): it gave its pages back
        out.print(f"request {request.request_id} holds no KV pages: {request.error}", markup=False, soft_wrap=True)
        return
    shared = request.cached_tokens // size
    out.print(f"request {request.request_id}: {cached:,} tokens cached in {len(pages)} "
              f"{'page' if len(pages) == 1 else 'pages'} of {size} tokens"
              + (f", {shared} of them from the prefix cache" if shared else "")
              + f"\neach page: {format_bytes(llm.pool.nbytes / llm.pool.num_pages)}, {llm.pool.format}", markup=False)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    tags = request.expected_tags or [None] * len(pages)   # no tags with integrity off
    for name in ("page", "physical", "tag", "tokens", "filled"):
        table.add_column(name, justify="right")
    for index, (physical, tag) in enumerate(zip(pages, tags)):
        first, last = index * size, min((index + 1) * size, cached) - 1
        table.add_row(str(index), str(physical), "–" if tag is None else str(tag), f"{first}–{last}",
                      f"{last - first + 1}/{size}")
    out.print(table)
    if llm.counters()["prefix_cache"]:
        out.print("a finished request's full pages stay in the prefix cache: the next turn takes those its prompt "
                  "starts with and computes only the rest", style="dim", markup=False)
    else:
        out.print("nano frees a request's pages when it finishes (--no-prefix-cache): these pages are free again, "
                  "and the next turn computes the whole conversation anew", style="dim", markup=False)


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


def read_line(prompt: str, interactive: bool) -> str:
    """One line of input (EOFError at its end); a line that is not UTF-8 is a NanoError. Piped input is read and
    decoded a line at a time, so the lines before a bad one are answered first."""
    if interactive:
        return utf8_text(input(prompt), "the input")   # a terminal's bytes arrive as lone surrogates
    raw = sys.stdin.buffer.readline()
    if not raw:
        raise EOFError
    try:
        return raw.decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError:
        raise NanoError("the input is not valid UTF-8 text") from None


def chat_loop(conversation: Conversation) -> None:
    """Read turns until /exit or end of input. On a terminal: a `>>> ` prompt, and an error or Ctrl-C during
    a reply only ends that reply. With stdin piped, each line is a turn and the first error ends the run."""
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (gives input() line editing and history)
        err.print("Type a message. /help lists the commands; /exit or Ctrl-D quits.", style="dim")
    while True:
        try:
            line = read_line(">>> ", interactive).strip()
        except EOFError:
            if interactive:
                write_model_text("\n")
            return
        except NanoError as error:   # a line that is not UTF-8: on a terminal, type it again
            if not interactive:
                raise
            print_error(str(error))
            continue
        if not line:
            continue
        if line == '"""':   # multi-line input: every line up to the next """ line is one message
            lines = []
            try:
                while (part := read_line("... ", interactive)).strip() != '"""':
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
        err.print(summary(reply), style="dim", markup=False)


@engine_flags()
def chat(
    context: typer.Context,
    model: Model,
    prompt: Annotated[str | None, typer.Option(
        "--prompt", "-p", metavar="TEXT", help="Answer this one message, then exit.")] = None,
    system: Annotated[str | None, typer.Option(
        metavar="TEXT", help="System message that opens the conversation.")] = None,
    max_tokens: Annotated[int, typer.Option(metavar="N", min=1, help=(
        "Most tokens in one reply. Unset: 256, or the room the KV pool leaves if less."))] = 256,
    temperature: Annotated[float, typer.Option(
        metavar="F", min=0.0, help="Sampling temperature: 0 (greedy) or at least 1e-5.")] = 0.7,
    top_p: Annotated[float, typer.Option(metavar="F", help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(
        metavar="N", min=0, help="Sample from the k most likely tokens; 0 is off.")] = 0,
    seed: Annotated[int | None, typer.Option(
        metavar="N", **SEED_RANGE, help="Sampling seed, for repeatable replies. Unset: a fresh one per reply.")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="With -p: print one JSON object (text, token ids, counts, timings).")] = False,
    *,
    engine: EngineOptions,
) -> None:
    """Chat with a model: interactive, or one reply with -p.

    Slash commands: /help /reset /stats /pages /set /system /exit; a line of \"\"\" starts and ends multi-line
    input."""
    typed = typed_flags(context)
    with user_errors():
        if as_json and prompt is None:
            raise UsageError("--json needs -p/--prompt (it prints one reply as one JSON object)")
        if prompt is not None and not prompt.strip():
            raise UsageError("--prompt is empty")
        for flag, text in (("--prompt", prompt), ("--system", system)):
            try:
                utf8_text(text or "", flag)
            except NanoError as error:
                raise UsageError(str(error)) from None
        from nano.sampling import SamplingParams
        try:   # the library's and the server's sampling rules; each message starts with the field, named as its flag
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                    max_tokens=max_tokens)
        except NanoError as error:
            raise UsageError(f"--{str(error).replace('_', '-')}") from None
        if temperature == 0.0:   # greedy: sampling flags do nothing (but /set temperature may turn sampling on)
            for name in ("top_p", "top_k", "seed"):
                if name in typed:
                    warn(f"--{name.replace('_', '-')} does nothing while --temperature is 0 (greedy decoding)")
        llm = engine.build(model, progress=sys.stderr.isatty())
        from nano.disagg import SplitLLM
        try:
            converse(llm, model, params, system, prompt, as_json, "max_tokens" in typed)
        finally:
            if isinstance(llm, SplitLLM):
                llm.close()


def refuse_max_tokens(conversation: Conversation, prompt: str | None) -> None:
    """--max-tokens refused (a usage error) as the server refuses max_tokens: when it and the prompt (-p's message,
    else the shortest conversation: the system message and an empty message) do not fit one request. A prompt that
    alone does not fit is the reply's error (exit 1), as without --max-tokens."""
    from nano.llm import check_request_fits   # here: the CLI starts without loading torch

    llm, max_tokens = conversation.llm, conversation.params.max_tokens
    messages = [*conversation.opening, {"role": "user", "content": prompt or ""}]
    prompt_tokens = len(llm.tokenizer.encode_chat(messages))
    room = llm.max_request_tokens - prompt_tokens
    try:
        check_request_fits(prompt_tokens, max_tokens, llm.max_request_tokens, llm.max_context, at_least=prompt is None)
    except NanoError as error:
        if room >= 1:
            pool_bound = llm.max_request_tokens < llm.max_context
            raise UsageError(f"{error}: use --max-tokens {room} or less"
                             + (" or a bigger --kv-budget" if pool_bound else "")) from None


def converse(llm: LLM | SplitLLM, model: str, params: SamplingParams, system: str | None, prompt: str | None,
             as_json: bool, max_tokens_given: bool) -> None:
    """The chat session proper: interactive, or one reply (as text or as JSON)."""
    from nano.disagg import SplitLLM
    err.print(llm.label + (f" · split: prefill pid {llm.info['prefill']['pid']}, decode pid "
                           f"{llm.info['decode']['pid']}" if isinstance(llm, SplitLLM) else ""),
              style="bold", markup=False)
    conversation = Conversation(llm, params, system, max_tokens_given)
    if max_tokens_given:
        refuse_max_tokens(conversation, prompt)
    if prompt is None:
        chat_loop(conversation)
    elif as_json:
        typer.echo(reply_json(model, llm.label, conversation.reply(prompt)))
    else:
        reply = conversation.reply(prompt, write_model_text)
        write_model_text("\n")
        err.print(summary(reply), style="dim", markup=False)
