"""Time one scheduling decision at N running decodes: `python benchmarks/schedule.py [N]` (default 256).

Every request has prefilled and waits for its next token, so `Scheduler.schedule` picks all N of them. The figure
is the median of 50 calls, measured on this machine; run it on another tree (PYTHONPATH=that/tree) to compare.
"""
from __future__ import annotations

import statistics
import sys
import time

from nano import LLM, SamplingParams

running = int(sys.argv[1]) if len(sys.argv) > 1 else 256
llm = LLM("glm-5.2-random", page_size=16, kv_budget="64MiB", max_running=running, max_step_tokens=16 * running,
          progress=False)
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
for i in range(running):
    llm.submit([1 + i % 200, 2, 3, 4], params)
llm.poll()                                    # every prompt prefills in this one step
scheduler = llm.engine.scheduler
assert len(scheduler.running) == running
times = []
for _ in range(50):
    start = time.perf_counter()
    scheduled = scheduler.schedule([])
    times.append(time.perf_counter() - start)
assert len(scheduled) == running
print(f"schedule() at {running} running decodes, measured here: median {statistics.median(times) * 1e3:.2f} ms "
      f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}, 50 calls)")
