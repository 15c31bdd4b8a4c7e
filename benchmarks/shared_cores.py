"""How nano behaves when other processes share its cores: OpenMP threads that spin versus threads that sleep.

    python benchmarks/shared_cores.py                     # busy processes = 2 × cores; 3 rounds
    python benchmarks/shared_cores.py --busy 0            # the same, on an otherwise idle machine
    python benchmarks/shared_cores.py --spin-counts 300000,3000,1000,0 --busy 4   # one thread per core, each count
    python benchmarks/shared_cores.py --busy 4 -- python -m pytest -q tests    # time any command under that load

Each configuration runs `python -m nano chat glm-5.2-random -p hi --max-tokens 16 --temperature 0 --json` as a fresh
process (import, build the stand-in, one reply) while `--busy` processes spin on the same cores:

    spinning       one thread per core that spins 300,000 times before it sleeps (libgomp's default): what
                   torch did before nano chose
    brief spin     one thread per core that spins 1,000 times (nano/__init__.py sets GOMP_SPINCOUNT=1000)
    nano default   the brief spin, and one thread per core that the load average leaves free (cli/machine.py)

With `--spin-counts`, the configurations are instead one thread per core with each GOMP_SPINCOUNT given (0 is
OMP_WAIT_POLICY=PASSIVE), and one thread. The busy processes start a minute before the first run, so that the load
average has seen them. The order is interleaved (A B C C B A per round) so that drifts in the background load hit
every configuration alike; the table gives medians and the spread (max − min) / median of each. With a command
after `--`, it runs that command once under the load and prints its wall time.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

CHAT = [sys.executable, "-m", "nano", "chat", "glm-5.2-random", "-p", "hi", "--max-tokens", "16", "--temperature", "0",
        "--json"]
CORES = len(os.sched_getaffinity(0))
CONFIGURATIONS = {"spinning": ({"GOMP_SPINCOUNT": "300000"}, ["--threads", str(CORES)]),
                  "brief spin": ({}, ["--threads", str(CORES)]),
                  "nano default": ({}, [])}


def spin() -> None:
    while True:
        pass


def run_once(env: dict[str, str], extra: list[str]) -> tuple[float, float]:
    """(wall seconds of the whole process, seconds of the reply itself as the engine measured it)."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    started = time.perf_counter()
    done = subprocess.run(CHAT + extra, capture_output=True, text=True, env={**base, **env}, timeout=900)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"error: the chat failed: {done.stderr.strip().splitlines()[-1]}")
    return wall, json.loads(done.stdout)["timings"]["total_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=2 * CORES,
                        help="busy processes competing for the cores (default: 2 × cores)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of A B C C B A")
    parser.add_argument("--spin-counts", help="compare these GOMP_SPINCOUNT values (comma-separated) instead")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND: time it under the load instead")
    args = parser.parse_args()
    cores = CORES
    load = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for process in load:
        process.start()
    try:
        if args.command:
            command = args.command[1:] if args.command[0] == "--" else args.command
            started = time.perf_counter()
            code = subprocess.run(command).returncode
            print(f"measured here: {' '.join(command)} took {time.perf_counter() - started:.0f} s (exit {code}) on "
                  f"{cores} cores with {args.busy} busy processes beside it")
            return
        if args.busy:
            time.sleep(60)    # the 1-minute load average, which nano's default reads, catches up with the load
        configurations = CONFIGURATIONS if not args.spin_counts else {
            **{f"spin {int(n):,}": ({"GOMP_SPINCOUNT": n}, ["--threads", str(cores)])
               for n in args.spin_counts.split(",")}, "1 thread": ({}, ["--threads", "1"])}
        names = list(configurations)
        order = [name for _ in range(args.rounds) for name in names + names[::-1]]
        wall: dict[str, list[float]] = {name: [] for name in names}
        reply: dict[str, list[float]] = {name: [] for name in names}
        for name in order:
            w, r = run_once(*configurations[name])
            wall[name].append(w)
            reply[name].append(r)
    finally:
        for process in load:
            process.terminate()
    spread = lambda xs: (max(xs) - min(xs)) / statistics.median(xs)
    print(f"measured here: {cores} cores, {args.busy} busy processes beside nano, {2 * args.rounds} runs per "
          f"configuration interleaved (A B C C B A); median [spread = (max - min) / median]")
    print(f"{'configuration':<16}{'whole process s':>22}{'16-token reply s':>22}")
    for name in names:
        print(f"{name:<16}{statistics.median(wall[name]):>13.2f} [{spread(wall[name]):>4.0%}]"
              f"{statistics.median(reply[name]):>13.2f} [{spread(reply[name]):>4.0%}]")


if __name__ == "__main__":
    main()
