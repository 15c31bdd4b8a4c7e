"""Triton kernels for the engine's GPU paths (and, under TRITON_INTERPRET=1, for CPU tests).

Importing this package does not import triton: each kernel entry point (`mla_decode_paged`; `w4a16_gemm` and
`fp8_gemm`, the quantized-weight GEMMs of nano.kernels.gemm; `fused_moe` and `moe_align_block_size`, the fused
MoE over INT4 or FP8 experts of nano.kernels.moe) loads its module on first use, so nano runs without triton, and
TRITON_INTERPRET is read only when a kernel is first needed. triton is not a dependency of nano (CPU installs run
on PyTorch without it): it comes with the `gpu` extra, and an entry point asked for without it raises one NanoError
line that says how to install it (`require_triton`).
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch

from nano.errors import NanoError

INSTALL_HINT = "pip install 'nano[gpu]'"


def triton_available() -> bool:
    """True when the kernels can run here: triton imports, and either CUDA is present or the kernels were
    built for the interpreter (TRITON_INTERPRET=1 when nano.kernels.common was first imported)."""
    if importlib.util.find_spec("triton") is None:
        return False
    from nano.kernels import common
    return common.INTERPRETED or torch.cuda.is_available()


def require_triton(what: str = "the GPU kernels") -> None:
    """Raise a one-line NanoError that says how to install triton, unless it is installed. `what` names what
    needs it, as the subject of "... needs triton"."""
    if importlib.util.find_spec("triton") is None:
        raise NanoError(f"{what} needs triton, which is not installed: {INSTALL_HINT}")


# entry point -> (its module, what it is, for the error without triton)
_LAZY_EXPORTS = {
    "mla_decode_paged": ("nano.kernels.mla_decode", "the paged MLA decode kernel (GPU)"),
    "w4a16_gemm": ("nano.kernels.gemm", "the INT4 GEMM kernel (GPU INT4 weights)"),
    "fp8_gemm": ("nano.kernels.gemm", "the FP8 GEMM kernel (GPU FP8 weights)"),
    "fused_moe": ("nano.kernels.moe", "the fused MoE kernel (GPU INT4 or FP8 experts)"),
    "moe_align_block_size": ("nano.kernels.moe", "the fused MoE kernel (GPU INT4 or FP8 experts)"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_EXPORTS:
        module, what = _LAZY_EXPORTS[name]
        require_triton(what)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
