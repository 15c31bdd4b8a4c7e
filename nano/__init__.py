"""nano: a compact inference engine for MLA + MoE models (Kimi K2.x, GLM-5.x)."""
from nano.errors import NanoError
from nano.llm import LLM, RequestOutput
from nano.sampling import SamplingParams

__all__ = ["LLM", "NanoError", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
