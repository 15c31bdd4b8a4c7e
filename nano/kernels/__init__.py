"""Triton kernels for the engine's GPU paths (and, under TRITON_INTERPRET=1, for CPU tests).

Importing this package does not import triton: `mla_decode_paged` loads nano.kernels.mla_decode on first use,
so nano runs without triton, and TRITON_INTERPRET is read only when a kernel is first needed.
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch


def triton_available() -> bool:
    """True when the kernels can run here: triton imports, and either CUDA is present or the kernels were
    built for the interpreter (TRITON_INTERPRET=1 when nano.kernels.mla_decode was first imported)."""
    if importlib.util.find_spec("triton") is None:
        return False
    from nano.kernels import mla_decode
    return mla_decode.INTERPRETED or torch.cuda.is_available()


def __getattr__(name: str) -> Any:
    if name == "mla_decode_paged":
        from nano.kernels.mla_decode import mla_decode_paged
        return mla_decode_paged
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
