"""nano: a compact inference engine for MLA + MoE models (Kimi K2.x, GLM-5.x)."""
import os

# OpenMP threads that finish their share of an op spin, waiting for the next one (libgomp's default). On cores
# shared with other processes that spinning steals the time the other threads need: measured here on 2 shared
# cores under a load of 4 busy processes, building the glm-5.2 stand-in and decoding 4 tokens took 24 s + 13 s
# with spinning threads and 7 s + 0.2 s with sleeping ones (7 s + 0.2 s with one thread). So threads sleep
# unless the user chose otherwise. libgomp reads this once, when torch loads it: set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from nano.errors import NanoError  # noqa: E402
from nano.llm import LLM, RequestOutput  # noqa: E402
from nano.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "NanoError", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
