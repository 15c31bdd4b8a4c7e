"""Draw the charts the docs show (docs/images/*.svg), each by the exact command its doc prints beside it.

    python benchmarks/charts.py                 # all of them, one after another: about 15 min on 2 idle cores
    python benchmarks/charts.py kv-sweep.svg    # one

Each command runs as a user runs it (`python -m nano ...`, in docs/images/, so its `--plot NAME` lands there) and
measures on this machine: the charts' captions name the device and the load average at the end of the run. This
script prints each command's wall time and the load average before and after it. tests/test_docs.py checks that
each doc shows its command and its image side by side, and that no image in docs/images is left without one.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
# image -> (the doc that shows it, the command that draws it)
CHARTS: dict[str, tuple[str, str]] = {
    "kv-sweep.svg": ("paged-kv.md", "nano bench glm-5.2-random --sweep-concurrency 8,32,64 --compare kv-dtype=bf16,fp8 "
                                    "--num-prompts 128 --input-len 100 --output-len 32 --kv-budget 11300000 "
                                    "--page-size 16 --threads 1 --plot kv-sweep.svg"),
    "blog.svg": ("bench.md", "nano bench glm-5.2-random --reproduce-blog --plot blog.svg"),
    "profile.svg": ("bench.md", "nano profile glm-5.2-random --plot profile.svg"),
    "eval-kimi-kv.svg": ("eval.md", "nano eval kimi-k2.6 --context 128,256,512,1024 --compare kv-dtype=bf16,fp8 "
                                    "--plot eval-kimi-kv.svg"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", choices=[[], *CHARTS], metavar="NAME",
                        help=f"charts to draw (default: all): {', '.join(CHARTS)}")
    names = parser.parse_args().names or list(CHARTS)
    IMAGES.mkdir(exist_ok=True)
    for name in names:
        doc, command = CHARTS[name]
        before = os.getloadavg()[0]
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "nano", *shlex.split(command)[1:]], cwd=IMAGES)
        if result.returncode:
            sys.exit(f"{command}: exit {result.returncode}")
        print(f"{name} (docs/{doc}): {time.perf_counter() - started:.0f} s, load average {before:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after", flush=True)


if __name__ == "__main__":
    main()
