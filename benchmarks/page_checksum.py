"""What the prefix cache's page checksums cost (docs/integrity.md): the checksum taken when pages enter the cache
and the one verified when a request takes the hit, beside a prefill of the same tokens and a decode step.

    python benchmarks/page_checksum.py [--pages 1,4,16] [--rounds 7] [--kv-dtype fp32] [--threads 1]

For each page count k, on the random glm-5.2 stand-in with 16-token pages:
  A  the checksums of k pages as `Scheduler.cache_pages` takes them (`IntegrityTracker.on_cache`) and as a lookup
     verifies them (`first_corrupt`: the same sums, the compare and its host sync); each the mean of 20 calls;
  B  one request of k * 16 prompt tokens on a fresh engine (integrity on, prefix cache off): its prefill, one step,
     then its first decode step (batch 1, context k * 16 tokens).
Each round runs A B B A, so neither comes first or last every time; the table gives medians over all samples.
Last, the same checksums over pages of the full-size GLM-5.2 shape in bf16 (a pool alone, no weights), for scale:
the cost grows with a page's bytes, and the model's compute far faster.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
import nano  # noqa: E402,F401  (before torch: libgomp's short spin)
import torch  # noqa: E402

from nano import LLM, SamplingParams  # noqa: E402
from nano.config import ModelConfig  # noqa: E402
from nano.engine import Engine  # noqa: E402
from nano.integrity import IntegrityTracker  # noqa: E402
from nano.kv import KVPool  # noqa: E402
from nano.presets import GLM52  # noqa: E402

PAGE = 16


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def seconds(run: Callable[[], object], calls: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def checksum_times(tracker: IntegrityTracker, pages: list[int]) -> tuple[float, float]:
    """(cache time, lookup time) of the checksums of `pages`, each the mean of 20 calls."""
    return seconds(lambda: tracker.on_cache(pages), 20), seconds(lambda: tracker.first_corrupt(pages), 20)


def prefill_and_decode(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    engine = Engine(llm.model, llm.pool, set(), integrity=True, prefix_cache=False, max_step_tokens=len(prompt))
    engine.add(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), len(prompt) + 2)
    prefill, decode = seconds(engine.step), seconds(engine.step)
    assert not engine.has_work()
    return prefill, decode


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="1,4,16", help="page counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kv-dtype", default="fp32", choices=["fp32", "bf16", "fp8"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    counts = [int(k) for k in args.pages.split(",")]
    load_before = os.getloadavg()
    llm = LLM("glm-5.2-random", page_size=PAGE, kv_dtype=args.kv_dtype, threads=args.threads, progress=False)
    tracker = Engine(llm.model, llm.pool, set(), integrity=True).integrity
    generator = torch.Generator().manual_seed(0)
    page_mb = llm.pool.nbytes / llm.pool.num_pages / 2**20
    print(f"measured here: {cpu_name()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), {llm.label}, {llm.pool.kv_dtype} KV, {PAGE}-token pages of "
          f"{page_mb * 1024:.0f} KiB, {args.rounds} rounds of A B B A; load average {load_before[0]:.2f} at start")
    print(f"{'pages':>5} {'tokens':>6} | {'cache ms':>9} {'lookup ms':>9} | {'prefill ms':>10} {'decode ms':>9} | "
          f"{'cache/prefill':>13} {'lookup/prefill':>14} {'lookup/decode':>13}")
    for k in counts:
        pages = list(range(k))
        prompt = torch.randint(1, 256, (k * PAGE,), generator=generator).tolist()
        prefill_and_decode(llm, prompt)                                       # warm-up
        checksum_times(tracker, pages)
        cache, lookup, prefill, decode = [], [], [], []
        for _ in range(args.rounds):
            for part in ("A", "B", "B", "A"):
                if part == "A":
                    times = checksum_times(tracker, pages)
                    cache.append(times[0])
                    lookup.append(times[1])
                else:
                    times = prefill_and_decode(llm, prompt)
                    prefill.append(times[0])
                    decode.append(times[1])
        c, lk, p, d = (1e3 * statistics.median(v) for v in (cache, lookup, prefill, decode))
        print(f"{k:>5} {k * PAGE:>6} | {c:>9.3f} {lk:>9.3f} | {p:>10.1f} {d:>9.1f} | {c / p:>13.2%} {lk / p:>14.2%} "
              f"{lk / d:>13.2%}")
    full = KVPool(ModelConfig.from_hf(GLM52), "bf16", max(counts), PAGE)
    full_tracker, full_mb = IntegrityTracker(full), full.nbytes / full.num_pages / 2**20
    for k in counts:
        c, lk = (1e3 * statistics.median(v) for v in zip(*(checksum_times(full_tracker, list(range(k)))
                                                         for _ in range(args.rounds))))
        print(f"full-size GLM-5.2 shape, bf16, {k} page(s) of {full_mb:.2f} MiB: cache {c:.2f} ms, lookup {lk:.2f} ms "
              f"({k * full_mb / (lk / 1e3) / 1024:.2f} GiB/s)")
    print(f"load average {os.getloadavg()[0]:.2f} at the end (1-minute; {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
