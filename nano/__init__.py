"""nano: a compact inference engine for MLA + MoE models (Kimi K2.x, GLM-5.x)."""
import os
import sys

# An OpenMP thread that finishes its share of an op spins before it sleeps, waiting for the next op: libgomp (the
# runtime in torch's CPU wheel) spins 300,000 times by default. On cores shared with other busy processes that
# spinning steals the time the other threads need. Measured here on 2 cores, 2 threads, a 16-token reply of the
# glm-5.2-random stand-in (median of 4 interleaved runs; benchmarks/shared_cores.py):
#     spin count    idle      beside 4 busy processes
#     300,000       0.062 s   6.75 s    (libgomp's default)
#     1,000         0.074 s   0.26 s    (nano's default)
#     0 (PASSIVE)   0.113 s   0.18 s
# A short spin keeps most of the idle speed and degrades gracefully. libgomp reads this once, when torch loads
# it: set before torch is imported, and only when the user has chosen no policy. When torch came first, libgomp
# already spins its default and the variable stays unset, so `nano.llm.default_threads` knows and runs one thread
# (a lone thread has no barrier to spin at).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ and "torch" not in sys.modules:
    os.environ["GOMP_SPINCOUNT"] = "1000"

from typing import TYPE_CHECKING, Any  # noqa: E402

from nano.errors import NanoError  # noqa: E402

if TYPE_CHECKING:
    from nano.llm import LLM, RequestOutput
    from nano.sampling import SamplingParams

__all__ = ["LLM", "NanoError", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`nano.LLM`, `nano.RequestOutput` and `nano.SamplingParams`, imported on first use: they load torch, which
    takes seconds, and `import nano` alone (the `nano` command answering -h, or a bad flag) should not wait."""
    if name in ("LLM", "RequestOutput"):
        from nano import llm
        return getattr(llm, name)
    if name == "SamplingParams":
        from nano.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'nano' has no attribute {name!r}")
