"""What this machine is and how fast it copies: the context every benchmark report carries."""
from __future__ import annotations

import mmap
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """What a figure measured on `device` was measured on, in a few words: the GPU's name, or the CPU's with
    the threads torch uses."""
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, torch threads: {torch.get_num_threads()}"


def installed_version(package: str) -> str | None:
    """A package's version, or None when it is not installed (triton is optional on CPU)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions, CPU, GPU, the time and the load (the 1-minute average, now): what a benchmark's figures were
    measured on."""
    import torch
    return {"nano": installed_version("nano"), "torch": torch.__version__, "triton": installed_version("triton"),
            "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_average": os.getloadavg()[0]}


def copy_seconds(nbytes: int, shared: bool = False, repeats: int = 20, trials: int = 5,
                 device: torch.device | str = "cpu") -> float:
    """Seconds for one copy of `nbytes` into a shared-memory mapping (`shared`: the kind of memory the split's
    staging slots are) or a plain tensor on `device`: the fastest of `trials` timings of `repeats` copies (other
    processes on the cores only ever slow a copy down, so the fastest trial is the nearest to what the memory can
    do)."""
    import torch
    mapping = mmap.mmap(-1, nbytes) if shared else None   # anonymous and MAP_SHARED, like a memfd mapping
    # the values do not matter to a copy; filling touches every page at a tenth of what drawing random bytes costs
    source = torch.full((nbytes,), 1, dtype=torch.uint8, device="cpu" if shared else device)
    sink = torch.frombuffer(mapping, dtype=torch.uint8) if mapping else torch.empty_like(source)
    sink.copy_(source)   # first touch
    wait = torch.cuda.synchronize if source.device.type == "cuda" else lambda: None   # GPU copies are async
    timings = []
    try:
        for _ in range(trials):
            wait()
            start = time.perf_counter()
            for _ in range(repeats):
                sink.copy_(source)
            wait()
            timings.append((time.perf_counter() - start) / repeats)
        return min(timings)
    finally:
        if mapping:
            del sink
            mapping.close()
