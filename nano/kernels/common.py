"""What the Triton kernels share: the interpreter switch, input checks, the tl.dot operand type, SM counts."""
from __future__ import annotations

import functools

import torch
import triton.language as tl
from triton import knobs

# Fixed when the kernels are first imported: @triton.jit reads TRITON_INTERPRET when it decorates a function.
# The interpreter (TRITON_INTERPRET=1, CPU tests) computes bf16 arithmetic wrongly, so kernels built for it do
# every product in fp32.
INTERPRETED: bool = knobs.runtime.interpret


def check_dot_sizes(**sizes: int) -> None:
    """tl.dot's dimensions must be powers of two >= 16 on NVIDIA; the interpreter would accept less, so they are
    checked here (one ValueError that names them all)."""
    if not all(n >= 16 and n & (n - 1) == 0 for n in sizes.values()):
        named = [f"{name}={n}" for name, n in sizes.items()]
        raise ValueError(f"{', '.join(named[:-1])} and {named[-1]} must be powers of two >= 16")


def check_same_device(*tensors: torch.Tensor) -> None:
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted({str(t.device) for t in tensors})}")


def dot_config(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """(tl.dot operand dtype, input precision) for operands of `dtype`: fp32 under the interpreter and for fp32
    data (ieee products); else the data's own 16-bit type."""
    if INTERPRETED or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.float16 if dtype == torch.float16 else tl.bfloat16), "tf32"


@functools.lru_cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
