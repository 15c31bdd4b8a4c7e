"""Suite-wide checks: the scheduler's invariants hold after every engine step of every test.

`Scheduler.check` (nano/scheduler.py) asserts the invariants its docstring lists. Every in-process engine step of
every test is followed by it; tests that break the bookkeeping on purpose (fault injection) are marked
`breaks_invariants` and run unchecked.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from nano.engine import Engine


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
