"""What a long command shows while it runs (`nano bench`, `--reproduce-blog`, `nano eval`): its plan first, then
which phase it is in and how long it has left.

A plan is phases of work units (requests, pairs of runs, tokens scored). Before the work starts, one line on
stderr announces it: each phase and its units, and, when the caller knows how long every phase took on 2 idle cores
(a fixed plan measured once: --reproduce-blog), the sum as "about N min on 2 idle cores". While it runs:

  * on a terminal, a live line: phase k/n and its name, a bar, the phase's units done, the time so far, the ETA;
  * otherwise (piped, logged), a plain line when a phase starts and at least every `interval` seconds (30), from
    a timer thread that reads only this object's counters (never the engine's), so that a line comes even while
    one unit (a model load, a long request) runs for minutes.

The ETA is measured as it goes, never taken from that calibration: the time so far over the work done so far,
times the work left. Phases weigh their units by `work` (tokens through the model), so one figure spans phases of
different units; it includes what lies between the units (model loads, warm-ups) in proportion, and firms up as the run
goes. Until a unit is done there is no ETA.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, ProgressColumn, Task, TextColumn
from rich.progress import Progress as LiveLine
from rich.text import Text

from .console import err

INTERVAL_S = 30.0    # the most seconds between two plain progress lines


@dataclass(frozen=True)
class Phase:
    name: str
    units: int
    unit: str = "requests"   # what a unit is, plural
    work: float = 1.0        # one unit's share of the plan's work, in a measure common to its phases (tokens)
    idle_s: float = 0.0      # seconds the whole phase took on 2 idle cores, measured (0: not known)


def duration(seconds: float) -> str:
    """'45 s', '3 min 05 s', '1 h 02 min'."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


class Progress:
    """A plan's progress on `console` (stderr). `with Progress(phases) as progress: ... progress.advance()`;
    the units count through the phases in order, so a caller only advances. A plan known only once the work has
    begun (nano eval's windows, from the tokenized text) is given later with `plan`."""

    def __init__(self, phases: Sequence[Phase] | None = None, *, interval: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, console: Console = err) -> None:
        self.phases: list[Phase] = []
        self.done: list[int] = []
        self.current = 0
        self.interval, self.clock, self.console = interval, clock, console
        self.started = self.last_line = clock()
        self._first = phases
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._live: LiveLine | None = None

    def __enter__(self) -> Progress:
        if self._first is not None:
            self.plan(self._first)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._live is not None:
            self._live.stop()

    def plan(self, phases: Sequence[Phase]) -> None:
        """Announce the plan in one line and start showing where the work is."""
        with self._lock:
            self.phases, self.done, self.current = list(phases), [0] * len(phases), 0
            self.started = self.last_line = self.clock()
        self.console.print(self.plan_line(), markup=False, highlight=False)
        if self.console.is_terminal:
            self._live = LiveLine(TextColumn("{task.description}"), BarColumn(), StatusColumn(self),
                                  console=self.console, transient=True)
            self._live.add_task(self.phase_text())
            self._live.start()
        elif self.interval > 0:
            self._ticker = threading.Thread(target=self._tick_until_stopped, daemon=True, name="progress lines")
            self._ticker.start()

    def resize(self, units: int) -> None:
        """The current phase's size, now known (--reproduce-blog's accuracy phase: nano eval's tokens)."""
        with self._lock:
            self.phases[self.current] = replace(self.phases[self.current], units=max(units, self.done[self.current]))
        self._show()

    def advance(self, units: int = 1) -> None:
        """`units` more done; past the end of a phase they count in the next."""
        with self._lock:
            before = self.current
            self.done[self.current] += units
            while self.current + 1 < len(self.phases) and self.done[self.current] >= self.phases[self.current].units:
                extra = self.done[self.current] - self.phases[self.current].units
                self.done[self.current] = self.phases[self.current].units
                self.current += 1
                self.done[self.current] += extra
            started_a_phase = self.current != before
        self._show()
        if started_a_phase and self._live is None:
            self.line()

    # ---- what is shown ----------------------------------------------------------------------------------------
    def plan_line(self) -> str:
        phases = "; ".join(f"{phase.name} ({phase.units:,} {phase.unit})" for phase in self.phases)
        count = f"{len(self.phases)} phase{'s' if len(self.phases) != 1 else ''}"
        if self.phases and all(phase.idle_s > 0 for phase in self.phases):
            idle = duration(sum(phase.idle_s for phase in self.phases))
            count += f", about {idle} on 2 idle cores (measured there; longer on a busy machine)"
        return f"plan: {count}: {phases}. The ETA is measured as the run goes."

    def phase_text(self) -> str:
        return f"phase {self.current + 1}/{len(self.phases)} {self.phases[self.current].name}"

    def status(self, now: float | None = None) -> str:
        """The time so far and the ETA: that time over the work done, times the work left."""
        elapsed = (self.clock() if now is None else now) - self.started
        done = sum(count * phase.work for count, phase in zip(self.done, self.phases))
        left = sum((phase.units - count) * phase.work for count, phase in zip(self.done, self.phases))
        eta = f"about {duration(elapsed / done * left)} left" if done > 0 else "no ETA before the first unit"
        return f"{duration(elapsed)} so far · {eta}"

    def line(self, only_after: float = 0.0) -> None:
        """One plain progress line: the phase, its units done, the time so far and the ETA; none when the last
        one came less than `only_after` seconds ago."""
        with self._lock:
            now = self.clock()
            if now - self.last_line < only_after:
                return
            self.last_line = now
            phase, done = self.phases[self.current], self.done[self.current]
            text = f"{self.phase_text()}: {done:,}/{phase.units:,} {phase.unit} · {self.status(now)}"
        self.console.print(text, markup=False, highlight=False)

    def tick(self) -> None:
        """A plain line if `interval` seconds have passed since the last one."""
        self.line(only_after=self.interval)

    def _tick_until_stopped(self) -> None:
        while not self._stop.wait(min(self.interval, 1.0)):
            self.tick()

    def _show(self) -> None:
        if self._live is not None:
            task = self._live.tasks[0]
            phase = self.phases[self.current]
            self._live.update(task.id, description=self.phase_text(), completed=self.done[self.current],
                              total=phase.units)


class StatusColumn(ProgressColumn):
    """The units done of the phase's, the time so far and the ETA, read from the Progress at each refresh."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def render(self, task: Task) -> Text:
        phase = self.progress.phases[self.progress.current]
        return Text(f"{task.completed:,.0f}/{phase.units:,} {phase.unit} · {self.progress.status()}")


class EvalProgress:
    """nano eval's progress (nano.evaluate's `progress`) on a Progress: the configurations it runs become the
    plan's phases, or, when the Progress has a plan already (--reproduce-blog), size its current phase."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def planned(self, configurations: list[tuple[str, int]]) -> None:
        if self.progress.phases:
            self.progress.resize(sum(tokens for _, tokens in configurations))
        else:
            self.progress.plan([Phase(name, tokens, "tokens") for name, tokens in configurations])

    def advance(self, tokens: int) -> None:
        self.progress.advance(tokens)
