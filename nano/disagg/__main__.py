"""A worker: python -m nano.disagg ROLE HOST:PORT (with NANO_DISAGG_KEY set)."""
import sys

from nano.disagg.worker import connect_worker, worker_main
from nano.errors import NanoError

try:
    role, address = sys.argv[1:3]
    worker_main(role, connect_worker(role, address))
except (KeyboardInterrupt, EOFError, BrokenPipeError, ConnectionError):
    pass
except (NanoError, ValueError) as failure:
    sys.exit(f"error: {' '.join(str(failure).splitlines())}")
