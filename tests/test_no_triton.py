"""nano without triton: a CPU-only install has no triton (it is the `gpu` extra), and every CPU path must run.

"Not installed" is simulated in a child process: a sitecustomize.py on PYTHONPATH sets sys.modules["triton"] to
None before anything else runs, so `import triton` raises ImportError and importlib.util.find_spec("triton") is
None, as without the package; the workers that --disagg spawns inherit PYTHONPATH, so they are blocked too. One child
runs every check here (one interpreter and one torch import): the commands, as `python -m nano ...` would, one after
another, then an INT4 model. Each blocked command's output is compared with the same command run in this process,
where triton is installed (greedy, so the tokens must match; the split with one process in its formats, which
starts no workers here). On a machine with CUDA the command line would run on the GPU, so the CLI comparisons run
on CPU-only machines, the installs this is about. The model is conftest.py's tiny random GLM-5 checkpoint.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures import nano
from nano import LLM, SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
# `nano chat MODEL` with these flags. --json: the token ids, not only the text (random weights decode to replacement
# characters); 4 tokens, of which the fourth already tells the tiny model's fp32 and int4 weights apart for this
# prompt; a small KV pool, as the CPU default is 256 MiB zero-filled in every process
CHAT = ("-p", "the quick brown fox", "--max-tokens", "4", "--temperature", "0", "--json", "--kv-budget", "4MiB")

# Runs the sitecustomize this one shadows, if the interpreter has one further down its path.
BLOCKER = '''import importlib.machinery, importlib.util, os, sys
sys.modules["triton"] = None   # what `import triton` meets when triton is not installed
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''

# Runs each command of the JSON object in argv[1] as `python -m nano ARGS` does, in turn, keeping its exit code,
# stdout and stderr; then builds and runs an INT4 model (prefill and decode through INT4 experts) and reports what it
# saw of triton. Prints one JSON object.
CHILD = '''import contextlib, importlib.util, io, json, runpy, sys, traceback
report = {}
for name, args in json.loads(sys.argv[1]).items():
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = ["nano", *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("nano", run_name="__main__")
        except SystemExit as exited:   # as the interpreter takes it: None is 0, a message is printed and is 1
            if isinstance(exited.code, str):
                print(exited.code, file=sys.stderr)
            code = exited.code if isinstance(exited.code, int) else int(exited.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
    report[name] = {"exit_code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
from nano import LLM, NanoError, SamplingParams
from nano.kernels import triton_available
llm = LLM(sys.argv[2], weights="int4", device="cpu")
tokens = llm.generate(["hi"], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
try:
    from nano.kernels import w4a16_gemm
    error = None
except NanoError as caught:
    error = str(caught)
report["int4"] = {"tokens": list(tokens), "find_spec": importlib.util.find_spec("triton") is not None,
                  "available": triton_available(), "kernel_error": error,
                  "loaded": "triton" in sys.modules and sys.modules["triton"] is not None}
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a child process that cannot import triton."""
    folder = tmp_path_factory.mktemp("no_triton")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "200"}


def finish(child: subprocess.Popen, timeout: int = 240) -> str:
    """The child's stdout, once it has exited 0 without a traceback."""
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    finally:
        child.kill()
    assert child.returncode == 0, stderr[-4000:]
    assert "Traceback" not in stderr
    return stdout


# The split's workers (prefill: BF16 weights; decode: INT4 experts; FP8 KV on both sides here; the KV through shared
# memory, the default) against one process in the same formats, which tests/test_disagg.py shows equal to the split:
# the reference starts no workers.
SPLIT = ("--disagg", "--prefill-kv-dtype", "fp8")
ONE_PROCESS = ("--prefill-weights", "bf16", "--decode-weights", "int4", "--kv-dtype", "fp8")
CLI_CASES = {"default": ((), ()), "disagg": (SPLIT, ONE_PROCESS)}   # name: (blocked flags, reference flags)
CLI_HERE = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def model(tiny_glm5: Path) -> str:
    return str(tiny_glm5)


@pytest.fixture(scope="module")
def blocked(blocked_env: dict[str, str], model: str) -> Iterator[Callable[[], dict[str, Any]]]:
    """The child's report, once a test asks for it: the child starts here, and runs beside the references the
    tests compute meanwhile."""
    commands = {name: ["chat", model, *CHAT, *flags] for name, (flags, _) in CLI_CASES.items()} if CLI_HERE else {}
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(commands), model], cwd=REPO_ROOT,
                             env=blocked_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = functools.cache(lambda: json.loads(finish(child).strip().splitlines()[-1]))
    yield report
    child.kill()
    child.wait()


def test_pyproject_installs_triton_only_with_the_gpu_and_test_extras():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("triton") for dep in project["dependencies"])
    assert "triton" in project["optional-dependencies"]["gpu"]
    assert "triton" in project["optional-dependencies"]["test"]


@pytest.mark.skipif(not CLI_HERE, reason="the command line would run on the GPU")
@pytest.mark.parametrize("case", CLI_CASES)
def test_chat_without_triton_matches_chat_with_it(blocked, model, case):
    reference = nano("chat", model, *CHAT, *CLI_CASES[case][1])
    assert reference.exit_code == 0, reference.output
    run = blocked()[case]
    assert run["exit_code"] == 0 and "Traceback" not in run["stderr"], run["stderr"][-4000:]
    assert ("split: prefill pid" in run["stderr"]) == (case == "disagg")     # two worker processes answered
    without, with_triton = json.loads(run["stdout"]), json.loads(reference.stdout)
    assert without.pop("timings") and with_triton.pop("timings")
    assert without["token_ids"] and without == with_triton


def test_int4_engine_never_loads_triton_and_kernels_say_how_to_install_it(blocked, model):
    """And its tokens equal those of the same model here, with triton installed."""
    reference = LLM(model, weights="int4", device="cpu", progress=False).generate(
        ["hi"], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
    report = blocked()["int4"]
    assert report["find_spec"] is False and report["available"] is False    # the simulation holds
    assert report["loaded"] is False
    assert report["tokens"] and report["tokens"] == reference
    assert "pip install 'nano[gpu]'" in report["kernel_error"] and "\n" not in report["kernel_error"]
