"""The prefill/decode split, measured in one run: KV transfer throughput against a plain shared-memory copy of the
same bytes, and TTFT / inter-token latency of the split against one process.

    python benchmarks/disagg.py [--model glm-5.2] [--requests 16] [--input-len 512] [--output-len 32] [--json FILE]

split   two worker processes (nano/disagg.py): prefill bf16 weights + bf16 KV, decode int4 weights + fp8 KV
single  one process, the nearest configuration: bf16 weights for prefill steps, int4 for decode, fp8 KV

Transfer throughput = KV bytes moved / (prefill-side pack + checksum (Adler-32), decode-side verify + convert + write into its
pages). The baseline copies the same number of bytes into a shared-memory buffer and out again (two memcpys, what
any shared-memory transfer must do at least), in this process.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from nano import LLM, SamplingParams   # noqa: E402
from nano.disagg import SplitLLM, Staging   # noqa: E402


def latencies(outputs: list, token_times: list[list[float]] | None = None) -> dict[str, float]:
    ttft = [o.metrics["ttft_s"] for o in outputs]
    tpot = [o.metrics["tpot_s"] for o in outputs if "tpot_s" in o.metrics]
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] if len(xs) > 1 else xs[0]
    return {"ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p95_ms": 1e3 * q(ttft, 95),
            "itl_mean_ms": 1e3 * statistics.mean(tpot), "itl_p95_ms": 1e3 * q(tpot, 95)}


def plain_copy_gb_s(nbytes: int, repeats: int = 20) -> float:
    """Copy nbytes into a shared-memory buffer and back out (the minimum a shared-memory transfer does)."""
    staging = Staging(1, nbytes)
    source, sink = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    try:
        start = time.perf_counter()
        for _ in range(repeats):
            staging.buffer.copy_(source)
            sink.copy_(staging.buffer)
        return nbytes * repeats / (time.perf_counter() - start) / 1e9
    finally:
        staging.close(unlink=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="glm-5.2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    console = Console()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results = {}
    with SplitLLM(args.model, dtype="bfloat16") as split:
        prompts = [[rng.randrange(split.config.vocab_size) for _ in range(args.input_len)]
                   for _ in range(args.requests)]
        split.generate(prompts[:2], params)                         # warm-up
        moved_before = split.stats.bytes, split.stats.pack_s, split.stats.unpack_s
        start = time.perf_counter()
        outputs = split.generate(prompts, params)
        elapsed = time.perf_counter() - start
        moved = split.stats.bytes - moved_before[0]
        seconds = split.stats.pack_s + split.stats.unpack_s - moved_before[1] - moved_before[2]
        results["split"] = {**latencies(outputs), "output_tok_s": sum(len(o.token_ids) for o in outputs) / elapsed,
                            "transfer_bytes": moved, "transfer_s": seconds, "transfer_gb_s": moved / seconds / 1e9,
                            "pack_s": split.stats.pack_s - moved_before[1],
                            "unpack_s": split.stats.unpack_s - moved_before[2],
                            "pids": {role: split.info[role]["pid"] for role in ("prefill", "decode")}}
    single = LLM(args.model, dtype="bfloat16", prefill_weights="bf16", decode_weights="int4", kv_dtype="fp8",
                 progress=False)
    single.generate(prompts[:2], params)
    start = time.perf_counter()
    outputs = single.generate(prompts, params)
    elapsed = time.perf_counter() - start
    results["single"] = {**latencies(outputs), "output_tok_s": sum(len(o.token_ids) for o in outputs) / elapsed}
    per_request = results["split"]["transfer_bytes"] // args.requests
    baseline = plain_copy_gb_s(per_request)
    results["plain_copy_gb_s"] = baseline

    table = Table(title=f"prefill/decode split · {args.model} stand-in · {args.requests} requests × "
                        f"({args.input_len} in, {args.output_len} out), all at once · torch {torch.__version__}",
                  title_justify="left")
    for name in ("", "TTFT mean ms", "TTFT p95 ms", "ITL mean ms", "ITL p95 ms", "output tok/s"):
        table.add_column(name, justify="left" if not name else "right")
    for name in ("split", "single"):
        r = results[name]
        table.add_row(name, f"{r['ttft_mean_ms']:,.0f}", f"{r['ttft_p95_ms']:,.0f}", f"{r['itl_mean_ms']:.1f}",
                      f"{r['itl_p95_ms']:.1f}", f"{r['output_tok_s']:,.1f}")
    console.print(table)
    s = results["split"]
    console.print(f"KV moved: {s['transfer_bytes']:,} bytes in {args.requests} transfers "
                  f"({per_request:,} per request), {1e3 * s['transfer_s']:.1f} ms in all (prefill side "
                  f"{1e3 * s['pack_s']:.1f}, decode side {1e3 * s['unpack_s']:.1f}): "
                  f"{s['transfer_gb_s']:.2f} GB/s (pack + checksum + verify + convert into decode pages); a plain "
                  f"shared-memory copy of {per_request:,} bytes in and out: {baseline:.2f} GB/s; the transfer runs at "
                  f"{100 * s['transfer_gb_s'] / baseline:.0f}% of it. Worker pids: {s['pids']}.")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **results}, indent=2))


if __name__ == "__main__":
    main()
