"""One user's conversation, turn by turn, with the prefix cache and without: TTFT per turn, measured in one run.

    python benchmarks/prefix_cache.py [--model glm-5.2-random] [--turns 8] [--system 256] [--message 48]
                                      [--reply 16] [--page-size 16] [--rounds 4] [--json FILE]

Each round is a fresh conversation (its own random tokens): a system prompt of --system tokens, then --turns user
messages of --message tokens; turn k's prompt is the whole conversation so far (every earlier message and reply)
plus the new message, as `nano chat` sends it. The two configurations run the same conversation on one engine
each (the same weights), in the order on, off, off, on, … (A-B-B-A), after a warm-up conversation each. The table
shows each turn's median TTFT (arrival -> first token: the prefill) and the spread (min–max) over the rounds,
and the prompt tokens the model computed for that turn.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from nano import LLM, SamplingParams   # noqa: E402

CONFIGS = ("on", "off")


def conversation(llm: LLM, rng: random.Random, args: argparse.Namespace) -> list[dict[str, float]]:
    """Run one conversation; per turn: TTFT in ms, prompt tokens, tokens prefilled and tokens from the cache."""
    draw = lambda count: [rng.randrange(llm.config.vocab_size) for _ in range(count)]
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    history, turns = draw(args.system), []
    for _ in range(args.turns):
        prompt = history + draw(args.message)
        llm.counters(reset=True)
        output = llm.generate([prompt], params)[0]
        turns.append({"ttft_ms": 1e3 * output.metrics["ttft_s"], "prompt_tokens": len(prompt),
                      "computed": llm.counters()["prefill_tokens"], "cached": output.metrics["cached_tokens"]})
        history = prompt + output.token_ids
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="glm-5.2-random")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=256)
    parser.add_argument("--message", type=int, default=48)
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.turns, args.system, args.message, args.reply, args.page_size, args.rounds) < 1:
        parser.error("every count must be >= 1")
    llms = {config: LLM(args.model, page_size=args.page_size, prefix_cache=config == "on", progress=False)
            for config in CONFIGS}
    for llm in llms.values():   # warm-up
        conversation(llm, random.Random("warm-up"), args)   # its own tokens: nothing of it is measured
    runs: dict[str, list[list[dict[str, float]]]] = {config: [] for config in CONFIGS}
    for round_ in range(args.rounds):
        order = CONFIGS if round_ % 2 == 0 else CONFIGS[::-1]
        for config in order:
            runs[config].append(conversation(llms[config], random.Random(round_), args))

    table = Table(title=f"{llms['on'].label}: one conversation, TTFT per turn (median of {args.rounds} rounds, "
                        f"min–max), measured here on {llms['on'].device.type}, {torch.get_num_threads()} threads",
                  title_justify="left")
    for column in ("turn", "prompt tokens", "computed on", "TTFT on ms", "computed off", "TTFT off ms", "off / on"):
        table.add_column(column, justify="right")
    report = []
    for turn in range(args.turns):
        row = {"turn": turn + 1, "prompt_tokens": runs["on"][0][turn]["prompt_tokens"]}
        for config in CONFIGS:
            times = [run[turn]["ttft_ms"] for run in runs[config]]
            row[config] = {"ttft_ms_median": statistics.median(times), "ttft_ms_min": min(times),
                           "ttft_ms_max": max(times), "ttft_ms_by_round": times,
                           "computed": runs[config][0][turn]["computed"]}
        report.append(row)
        on, off = row["on"], row["off"]
        table.add_row(str(turn + 1), f"{row['prompt_tokens']:,}", f"{on['computed']:,}",
                      f"{on['ttft_ms_median']:.1f} ({on['ttft_ms_min']:.1f}–{on['ttft_ms_max']:.1f})",
                      f"{off['computed']:,}",
                      f"{off['ttft_ms_median']:.1f} ({off['ttft_ms_min']:.1f}–{off['ttft_ms_max']:.1f})",
                      f"{off['ttft_ms_median'] / on['ttft_ms_median']:.2f}")
    console = Console(width=max(Console().width, 130))
    console.print(table)
    console.print("prompt and computed tokens are the conversation's arithmetic (the same every round); computed "
                  "= prompt tokens the model prefilled (the cache holds whole pages; at least the last prompt "
                  "token is computed)", style="dim")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "turns": report}))


if __name__ == "__main__":
    main()
