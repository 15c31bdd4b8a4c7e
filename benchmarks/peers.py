"""nano against transformers' `generate` on one checkpoint: issue 26's peer workload, measured in one run.

    python benchmarks/peers.py [--prompts 64] [--rounds 2] [--dtype float32] [--batch 64] [--json FILE]

The checkpoint is a random DeepseekV3ForCausalLM saved by transformers itself (the architecture of
shared/reference/peers-cpu-43ab1ef.md: hidden 512, 8 layers, 32 routed experts top-8 + 1 shared, MLA q_lora 256 /
kv_lora 128 / rope 32 / nope 64 / v 64, vocab 512; without YaRN). The workload: --prompts prompts of 32-128 random
token ids (seed 3), 32 tokens out each, greedy, EOS ignored. nano runs them all through its engine (continuous
batching); transformers runs `generate` over left-padded batches of --batch prompts (its fastest way to run a set).
Both in this process, one torch thread, nano imported first (libgomp's short spin); rounds alternate the order
(A-B-B-A); the table gives medians with min–max, the load average, and how many outputs are identical.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))             # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the tests' checkpoint helpers
os.environ.setdefault("OMP_NUM_THREADS", "1")

from nano import LLM, SamplingParams   # noqa: E402  (nano before torch)

import torch   # noqa: E402
from fixtures import build_tokenizer_dir   # noqa: E402

PEER_CONFIG = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                   num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
                   kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=32,
                   num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                   max_position_embeddings=1024, tie_word_embeddings=False)


def build_checkpoint(path: Path) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**PEER_CONFIG))
    with torch.no_grad():   # transformers zero-initialises the selection bias; give it something to do
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(PEER_CONFIG["n_routed_experts"]) * 0.1)
    model.save_pretrained(path)
    build_tokenizer_dir(path)
    return path


def prompts(count: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(32, 129, (count,), generator=generator).tolist()
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def run_nano(llm: LLM, ids: list[list[int]], out: int) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = llm.generate(ids, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - started, [o.token_ids for o in outputs]


def run_transformers(model: torch.nn.Module, ids: list[list[int]], out: int, batch: int
                     ) -> tuple[float, list[list[int]]]:
    tokens = []
    started = time.perf_counter()
    for first in range(0, len(ids), batch):
        group = ids[first:first + batch]
        width = max(map(len, group))
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in group])                   # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            generated = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=out,
                                       min_new_tokens=out, do_sample=False, pad_token_id=0)
        tokens += generated[:, width:].tolist()
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.prompts, args.output_len, args.rounds, args.batch) < 1:
        parser.error("every count must be >= 1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs at the start; {torch.get_num_threads()} torch thread(s)")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "peer-deepseek-v3")
        llm = LLM(str(path), dtype=args.dtype, prefix_cache=False, progress=False)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        ids = prompts(args.prompts, PEER_CONFIG["vocab_size"])
        run_nano(llm, ids[:2], 2)                                   # warm-up, both
        run_transformers(model, ids[:2], 2, 2)
        systems = {"nano": lambda: run_nano(llm, ids, args.output_len),
                   "transformers": lambda: run_transformers(model, ids, args.output_len, args.batch)}
        times: dict[str, list[float]] = {name: [] for name in systems}
        tokens: dict[str, list[list[int]]] = {}
        for round_ in range(args.rounds):
            for name in systems if round_ % 2 == 0 else list(systems)[::-1]:
                seconds, tokens[name] = systems[name]()
                times[name].append(seconds)
                print(f"round {round_ + 1}: {name} {seconds:.1f} s", flush=True)
    same = sum(a == b for a, b in zip(tokens["nano"], tokens["transformers"]))
    total = sum(map(len, ids))
    print(f"\n{args.prompts} prompts ({total:,} prompt tokens), {args.output_len} out, {args.dtype}, measured here "
          f"({args.rounds} rounds, median (min–max)):")
    for name, seconds in times.items():
        print(f"  {name:13} {statistics.median(seconds):7.1f} s ({min(seconds):.1f}–{max(seconds):.1f})  "
              f"{args.prompts * args.output_len / statistics.median(seconds):6.1f} output tok/s")
    ratio = statistics.median(times["transformers"]) / statistics.median(times["nano"])
    print(f"nano vs transformers: {ratio:.2f}× (median times); outputs identical: {same}/{args.prompts}; "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "times_s": times,
                                         "ratio": ratio, "identical": same, "load_at_start": load}, indent=1))


if __name__ == "__main__":
    main()
