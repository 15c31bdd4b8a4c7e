"""What `Scheduler.check` (the allocator and scheduler invariants) costs beside a decode step, measured in one run:
the figures behind running it in production once per drain rather than every step (docs/paged-kv.md).

    python benchmarks/scheduler_check.py [--context 500] [--pages 4096] [--requests 64] [--steps 9]

The pool holds `--pages` 16-token pages. `--requests` requests of `--context` prompt tokens are admitted as if
prefilled elsewhere (`Engine.add_prefilled`, zero KV: a real prefill of 32k tokens takes minutes on a small CPU),
and their prompt pages go into the prefix cache as a prefill leaves them. Then, `--steps` times: one decode step
of them all, then one `check()`. Last, the requests end (the engine is idle, every prompt page cached) and
`check()` is timed again. Medians; one thread; the random glm-5.2 stand-in in float32.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
import nano  # noqa: E402,F401  (before torch: libgomp's short spin)
import torch  # noqa: E402

from nano import LLM, SamplingParams  # noqa: E402
from nano.llm import resolve_config  # noqa: E402

PAGE_SIZE = 16


def median_ms(run: Callable[[], object], times: int) -> float:
    timings = []
    for _ in range(times):
        start = time.perf_counter()
        run()
        timings.append(time.perf_counter() - start)
    return 1e3 * statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=500, help="prompt tokens per request")
    parser.add_argument("--pages", type=int, default=4096, help="pages in the pool")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    page_bytes = resolve_config("glm-5.2-random")[1].kv_bytes_per_token("fp32") * PAGE_SIZE   # nothing loaded
    llm = LLM("glm-5.2-random", page_size=PAGE_SIZE, threads=1, progress=False, kv_budget=page_bytes * args.pages)
    engine = llm.engine
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    shapes = llm.pool.token_shapes(args.context)
    zeros = {name: torch.zeros(shape, dtype=dtype) for name, (dtype, shape) in shapes.items()}
    for _ in range(args.requests):
        prompt = torch.randint(0, llm.config.vocab_size, (args.context,), generator=generator).tolist()
        request = engine.add_prefilled(prompt, 1, params, llm.max_context, zeros)
        if request is None:
            sys.exit(f"the pool of {args.pages} pages cannot hold {args.requests} requests of {args.context} tokens")
        engine.scheduler.cache_pages(request)
    allocator = engine.scheduler.allocator
    print(f"pool {llm.pool.num_pages:,} pages of {PAGE_SIZE} tokens; {args.requests} running, {args.context} "
          f"tokens each; {allocator.num_referenced:,} pages referenced, {len(allocator.cache):,} cached")
    step, check = [], []
    for _ in range(args.steps):
        step.append(median_ms(engine.step, 1))
        check.append(median_ms(engine.scheduler.check, 1))
    step_ms, check_ms = statistics.median(step), statistics.median(check)
    for request in list(engine.scheduler.running):
        engine.abort(request, "the measurement is over")
    idle_ms = median_ms(engine.scheduler.check, args.steps)
    print(f"measured here (one thread, medians): decode step {step_ms:.1f} ms; check() while running "
          f"{check_ms:.2f} ms = {check_ms / step_ms:.1%} of a step; check() idle {idle_ms:.2f} ms "
          f"({len(allocator.cache):,} pages cached)")


if __name__ == "__main__":
    main()
