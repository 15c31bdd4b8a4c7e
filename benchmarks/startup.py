"""How long `nano` takes to answer what needs no model: the help, the version, a mistyped flag, a value out of
range, an unknown model name.

    python benchmarks/startup.py              # 11 rounds
    python benchmarks/startup.py --rounds 31

Each command runs as a fresh process (`python -m nano ...`, the way the `nano` script starts it), beside two
baselines: `python -c pass` (the interpreter alone) and `python -c "import torch"` (what every command paid
before the command line stopped importing torch at the top, cli/main.py). The order is interleaved (each round
runs every command once, the order reversed every other round) so that drifts in the background load hit every
command alike. The table gives each command's median wall time, its spread ((max - min) / median) and the ratio
of the median to the 0.5 s target; the load average before and after says how busy the machine was.

The commands run as a user's do: with Python's bytecode cache (`__pycache__`). An environment that sets
PYTHONDONTWRITEBYTECODE (this project's CI machines do) compiles every module from source at every start, which
costs nano's own modules ~0.15 s; the children here run without it, after one untimed round that writes the cache.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

TARGET_S = 0.5   # issue 29: -h, --version and a command-line error answer within this
COMMANDS = {
    "nano -h": [sys.executable, "-m", "nano", "-h"],
    "nano --version": [sys.executable, "-m", "nano", "--version"],
    "nano chat --bogus": [sys.executable, "-m", "nano", "chat", "--bogus"],
    "nano chat glm-5.2 --temperature -1": [sys.executable, "-m", "nano", "chat", "glm-5.2", "--temperature", "-1"],
    "nano chat glm-5.2 --top-p 2": [sys.executable, "-m", "nano", "chat", "glm-5.2", "--top-p", "2"],
    "nano eval glm-5.2 --context 1": [sys.executable, "-m", "nano", "eval", "glm-5.2", "--context", "1"],
    "nano serve glm-9": [sys.executable, "-m", "nano", "serve", "glm-9"],
    "python -c pass": [sys.executable, "-c", "pass"],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
}
AS_A_USER = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
EXPECTED_CODES = {"nano chat --bogus": 2, "nano chat glm-5.2 --temperature -1": 2, "nano chat glm-5.2 --top-p 2": 2,
                  "nano eval glm-5.2 --context 1": 2, "nano serve glm-9": 1}


def wall_seconds(name: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(COMMANDS[name], capture_output=True, text=True, timeout=300, env=AS_A_USER)
    seconds = time.perf_counter() - started
    if done.returncode != EXPECTED_CODES.get(name, 0):
        sys.exit(f"error: {name} exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11, help="runs of each command (default: 11)")
    rounds = parser.parse_args().rounds
    for name in COMMANDS:        # untimed: writes the bytecode cache a user's second run finds
        wall_seconds(name)
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for round_ in range(rounds):
        for name in (COMMANDS if round_ % 2 == 0 else reversed(COMMANDS)):
            times[name].append(wall_seconds(name))
    load_after = os.getloadavg()
    print(f"{rounds} interleaved runs of each, measured here ({os.cpu_count()} cores; load average 1/5/15 min "
          f"before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, after "
          f"{load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f})")
    print(f"{'command':36} {'median s':>9} {'spread':>7} {'/ 0.5 s':>8}")
    for name, samples in times.items():
        median = statistics.median(samples)
        spread = (max(samples) - min(samples)) / median
        print(f"{name:36} {median:9.3f} {spread:7.0%} {median / TARGET_S:8.2f}")


if __name__ == "__main__":
    main()
