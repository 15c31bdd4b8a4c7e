"""nano without triton: a CPU-only install has no triton (it is the `gpu` extra), and every CPU path must run.

"Not installed" is simulated in child processes: a sitecustomize.py on PYTHONPATH sets sys.modules["triton"] to
None before anything else runs, so `import triton` raises ImportError and importlib.util.find_spec("triton") is
None, as without the package; the workers that --disagg spawns inherit PYTHONPATH, so they are blocked too. The
blocked command's output is compared with the same command run in this process, where triton is installed
(greedy, so the tokens must match; the split with one process in its formats, which starts no workers here).
On a machine with CUDA the command line would run on the GPU, so the CLI comparisons run on CPU-only machines,
the installs this is about.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import nano
from nano import LLM, SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
# --json: the token ids, not only the text (random weights decode to replacement characters); 4 tokens, where the
# third already tells bf16 and int4 apart
CHAT = ("chat", "glm-5.2-random", "-p", "hi", "--max-tokens", "4", "--temperature", "0", "--json")

# Runs the sitecustomize this one shadows, if the interpreter has one further down its path.
BLOCKER = '''import importlib.machinery, importlib.util, os, sys
sys.modules["triton"] = None   # what `import triton` meets when triton is not installed
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''

# Builds and runs an INT4 model (prefill and decode through INT4 experts), then reports what it saw of triton.
PROBE = '''import importlib.util, json, sys
from nano import LLM, NanoError, SamplingParams
from nano.kernels import triton_available
llm = LLM("glm-5.2-random", weights="int4", device="cpu")
tokens = llm.generate(["hi"], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
try:
    from nano.kernels import w4a16_gemm
    error = None
except NanoError as caught:
    error = str(caught)
print(json.dumps({"tokens": list(tokens), "find_spec": importlib.util.find_spec("triton") is not None,
                  "available": triton_available(), "kernel_error": error,
                  "loaded": "triton" in sys.modules and sys.modules["triton"] is not None}))
'''


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a child process that cannot import triton."""
    folder = tmp_path_factory.mktemp("no_triton")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "200"}


def start_blocked(env: dict[str, str], *args: str) -> subprocess.Popen:
    """`python ARGS...` without triton, started in the background."""
    return subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(child: subprocess.Popen, timeout: int = 120) -> str:
    """The child's stdout, once it has exited 0 without a traceback."""
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    finally:
        child.kill()
    assert child.returncode == 0, stderr[-4000:]
    assert "Traceback" not in stderr
    return stdout


def test_pyproject_installs_triton_only_with_the_gpu_and_test_extras():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("triton") for dep in project["dependencies"])
    assert "triton" in project["optional-dependencies"]["gpu"]
    assert "triton" in project["optional-dependencies"]["test"]


# The split's workers (prefill: BF16 weights; decode: INT4 experts; FP8 KV on both sides here) against one process
# in the same formats, which tests/test_disagg.py shows equal to the split: the reference starts no workers.
SPLIT = ("--disagg", "--prefill-kv-dtype", "fp8")
ONE_PROCESS = ("--prefill-weights", "bf16", "--decode-weights", "int4", "--kv-dtype", "fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the command line would run on the GPU")
@pytest.mark.parametrize("blocked_flags, reference_flags", [((), ()), (SPLIT, ONE_PROCESS)], ids=["bf16", "disagg"])
def test_chat_without_triton_matches_chat_with_it(blocked_env, blocked_flags, reference_flags):
    blocked = start_blocked(blocked_env, "-m", "nano", *CHAT, *blocked_flags)   # runs beside the reference
    try:
        reference = nano(*CHAT, *reference_flags)
    finally:
        output = finish(blocked)
    assert reference.exit_code == 0, reference.output
    without, with_triton = json.loads(output), json.loads(reference.stdout)
    assert without.pop("timings") and with_triton.pop("timings")
    assert without["token_ids"] and without == with_triton


def test_int4_engine_never_loads_triton_and_kernels_say_how_to_install_it(blocked_env):
    """And its tokens equal those of the same model here, with triton installed."""
    blocked = start_blocked(blocked_env, "-c", PROBE)                      # runs beside the reference
    try:
        reference = LLM("glm-5.2-random", weights="int4", device="cpu", progress=False).generate(
            ["hi"], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
    finally:
        report = json.loads(finish(blocked).strip().splitlines()[-1])
    assert report["find_spec"] is False and report["available"] is False    # the simulation holds
    assert report["loaded"] is False
    assert report["tokens"] and report["tokens"] == reference
    assert "pip install 'nano[gpu]'" in report["kernel_error"] and "\n" not in report["kernel_error"]
