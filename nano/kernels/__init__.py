"""Triton kernels for the engine's GPU paths (and, under TRITON_INTERPRET=1, for CPU tests).

Importing this package does not import triton: each kernel entry point (`mla_decode_paged`, `w4a16_gemm`,
`fused_moe_w4a16`, `moe_align_block_size`) loads its module on first use, so nano runs without triton, and
TRITON_INTERPRET is read only when a kernel is first needed.
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch


def triton_available() -> bool:
    """True when the kernels can run here: triton imports, and either CUDA is present or the kernels were
    built for the interpreter (TRITON_INTERPRET=1 when nano.kernels.common was first imported)."""
    if importlib.util.find_spec("triton") is None:
        return False
    from nano.kernels import common
    return common.INTERPRETED or torch.cuda.is_available()


_LAZY_EXPORTS = {
    "mla_decode_paged": "nano.kernels.mla_decode",
    "w4a16_gemm": "nano.kernels.int4_gemm",
    "fused_moe_w4a16": "nano.kernels.int4_moe",
    "moe_align_block_size": "nano.kernels.int4_moe",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_EXPORTS:
        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
