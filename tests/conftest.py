"""Suite-wide checks: the scheduler's invariants hold after every engine step of every test.

`Scheduler.check` (nano/scheduler.py) asserts the invariants its docstring lists. Every in-process engine step of
every test is followed by it; tests that break the bookkeeping on purpose (fault injection) are marked
`breaks_invariants` and run unchecked.

Also the checkpoints more than one test file builds, built once per session.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import nano  # noqa: F401  (first: it sets libgomp's short spin, which is read once, when torch loads libgomp)
import pytest
import torch

from nano.engine import Engine

# One thread count for the whole suite, in this process and in every command it starts (they inherit the variable):
# otherwise nano picks one per free core by the load average (nano/llm.py), and a golden run made in one
# process would be compared with a run that split its reductions differently in another.
# pytest-xdist's workers (pyproject.toml's addopts) share the cores out: each inherits the count and takes its part.
# They also get COLUMNS=80 set; the tests read what a pipe gets (120 columns, cli/console.py), wherever they run.
os.environ.pop("COLUMNS", None)
# The suite's processes and the commands they start keep compiled modules (__pycache__), as a user's machine does:
# under PYTHONDONTWRITEBYTECODE (set on this project's CI machines) each started command compiled nano from source.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "breaks_invariants: the test corrupts engine state on purpose (faults)")


@pytest.fixture(autouse=True)
def scheduler_invariants(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.node.get_closest_marker("breaks_invariants") is None:
        step = Engine.step

        def checked_step(self: Engine):
            events = step(self)
            self.scheduler.check()
            return events

        monkeypatch.setattr(Engine, "step", checked_step)
    yield


@pytest.fixture(scope="session")
def tiny_glm5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GLM-5 checkpoint with its tokenizer (tests/fixtures.py's TINY dimensions: 3 layers of width 64,
    4 experts, the DSA indexer; 4,096 positions, and an index_topk of 64 that keeps attention over a few pages of
    prompt dense, as in the glm-5.2-random stand-in). Random, so that a fault that reaches the KV changes answers;
    one step costs a seventh of the stand-in's (8 layers of width 512, 32 experts)."""
    from fixtures import build_tokenizer_dir, make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("tiny_glm5"), "glm_moe_dsa", max_position_embeddings=4096,
                           index_topk=64)
    build_tokenizer_dir(path)
    return path
