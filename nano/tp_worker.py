"""A rank of a tensor-parallel LLM that rank 0 started itself (`LLM(..., tp=N)`, `nano chat --tp N`): build the same
LLM from the arguments rank 0 put in the environment, then run the passes rank 0 sends until it stops.

    RANK=1 WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... NANO_TP_LLM='{...}' python -m nano.tp_worker
"""
from __future__ import annotations

import json
import os
import sys

from nano.errors import NanoError
from nano.llm import LLM
from nano.parallel import WORKER_ARGS_ENV


def main() -> None:
    try:
        LLM(**json.loads(os.environ[WORKER_ARGS_ENV])).serve()
    except NanoError as error:
        print(f"error: rank {os.environ.get('RANK', '?')}: {error}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError:   # rank 0 went away mid-pass: it reports the run's end
        sys.exit(1)
    # rank 0 said stop and waits for this process to end: Python's teardown of torch and the process group takes
    # about a second of CPU (1.2 to 4 s of wall time, measured on 2 shared cores at load 3 to 8), and nothing is
    # left to write but stdout (stderr is line-buffered: written already)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
