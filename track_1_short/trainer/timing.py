"""Time without host syncs: per-step and per-phase CUDA-event timing, host issue time, host syncs
per step, the train clock, compile counting.

StepTimer: the timed run's clock per step (DESIGN: the clock covers data, forward, backward and
optimizer; validation and checkpoints stop it). Events are recorded at step boundaries and read
once after the run, so the host never waits on the device for them; on CPU the host clock is used
(every op is synchronous there anyway).
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager

import torch

from track_1_short.perf import compile_cache


MICRO_PHASES = ("rows", "forward", "backward", "hold")  # marked once per micro-step by train_step


class StepTimer:
    """Per-step and per-phase milliseconds without host syncs: a CUDA event at the start of each
    timed step, at the end of each of its phases (`mark`) and at its end, read once the run is
    over (host clock on CPU, where every op is synchronous anyway).

    A phase's time is the compute stream's time from the previous mark to its own: its kernels,
    plus any gap in which the stream waited for the host. A phase marked several times in a step
    sums. Marks of a step that was not started are ignored (warmup steps run the same train_step
    untimed). train_step's marks, in order: per micro-step MICRO_PHASES (rows: the loader's batch
    and the n-gram row pull; forward: the forward replay; backward: the next micro-batch's row-id
    exchange, the backward replay and the gradient handoff; hold: the n-gram gradient into the
    store), then optimizer,
    ngram_update (event steps only). `micro_steps` is derived: the sum of the MICRO_PHASES."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: dict[int, list[tuple[str, object]]] = {}
        self.ms: dict[int, float] = {}
        self.phase_ms: dict[int, dict[str, float]] = {}
        # host time from start() to stop(): how long the host took to issue the step (it includes
        # any wait for the device, e.g. a host sync); below the step's device time = GPU-bound
        self.host_ms: dict[int, float] = {}
        self._host_start: dict[int, float] = {}

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, step: int) -> None:
        self._host_start[step] = time.perf_counter()
        self.pending[step] = [("start", self._now())]

    def mark(self, step: int, phase: str) -> None:
        """End of `phase` of a started step (no-op for a step that is not timed)."""
        if step in self.pending:
            self.pending[step].append((phase, self._now()))

    def stop(self, step: int) -> None:
        self.pending[step].append(("end", self._now()))
        self.host_ms[step] = (time.perf_counter() - self._host_start.pop(step)) * 1e3
        if not self.cuda:
            self._close(step, self.pending.pop(step))

    def _close(self, step: int, marks: list[tuple[str, object]]) -> None:
        def elapsed_ms(a, b) -> float:
            return a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        self.ms[step] = elapsed_ms(marks[0][1], marks[-1][1])
        phases: dict[str, float] = {}
        for (_, prev), (phase, t) in zip(marks, marks[1:]):
            if phase != "end":
                phases[phase] = phases.get(phase, 0.0) + elapsed_ms(prev, t)
        if any(p in phases for p in MICRO_PHASES):
            phases["micro_steps"] = sum(phases.get(p, 0.0) for p in MICRO_PHASES)
        self.phase_ms[step] = phases

    def resolve(self) -> dict[int, float]:
        """All step times (synchronizes once on CUDA); per-phase times land in `phase_ms`."""
        if self.pending:
            if self.cuda:
                torch.cuda.synchronize()
            for step, marks in self.pending.items():
                self._close(step, marks)
            self.pending.clear()
        return self.ms


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")


class SyncCounter:
    """Host syncs per timed step on CUDA: inside `count(step)`, torch.cuda.set_sync_debug_mode("warn")
    reports every synchronizing CUDA call as a warning, which is counted here (and not shown).
    On CPU nothing is counted (`per_step` stays empty: there is no device to wait for)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.per_step: dict[int, int] = {}

    @contextmanager
    def count(self, step: int):
        if not self.cuda:
            yield
            return
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        self.per_step[step] = sum(SYNC_WARNING in str(w.message) for w in caught)
        for w in caught:  # everything else is shown as it would have been
            if SYNC_WARNING not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@contextmanager
def counting_compiles(compiles: dict[str, int], phase: str):
    """Adds the graphs dynamo compiles inside the block to compiles[phase]."""
    before = compile_cache.graphs_compiled()
    try:
        yield
    finally:
        compiles[phase] = compiles.get(phase, 0) + compile_cache.graphs_compiled() - before


def sync(device: torch.device) -> None:
    """Wait for the device (a no-op on CPU): around the clock's start, stop and pauses."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TrainClock:
    """The timed run's wall clock, accumulated into `progress.train_time_s`: running during
    steps, stopped (with the device synchronized) around validation, checkpoints and trace export.
    `progress` is the trainer's Progress (anything with a float `train_time_s`)."""

    def __init__(self, progress, device: torch.device):
        self.progress, self.device = progress, device
        self.since: float | None = None  # perf_counter at the last (re)start; None: stopped

    def start(self) -> None:
        sync(self.device)
        self.since = time.perf_counter()

    def stop(self) -> None:
        sync(self.device)
        self.progress.train_time_s += time.perf_counter() - self.since
        self.since = None

    @contextmanager
    def paused(self):
        """Work that is not training stops the clock for the block."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def elapsed_s(self) -> float:
        """The run's train time so far, without a sync (the running part is host time)."""
        running = 0.0 if self.since is None else time.perf_counter() - self.since
        return self.progress.train_time_s + running
