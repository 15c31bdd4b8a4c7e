"""Suite-wide checks: the scheduler's invariants hold after every engine step of every test.

`Scheduler.check` (nano/scheduler.py) asserts the invariants its docstring lists. Every in-process engine step of
every test is followed by it; tests that break the bookkeeping on purpose (fault injection) are marked
`breaks_invariants` and run unchecked.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import nano  # noqa: F401  (first: it sets libgomp's short spin, which is read once, when torch loads libgomp)
import pytest
import torch

from nano.engine import Engine

# One thread count for the whole suite, in this process and in every command it starts (they inherit the variable):
# otherwise nano picks one per free core by the load average (nano/llm.py), and a golden run made in one
# process would be compared with a run that split its reductions differently in another.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


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
