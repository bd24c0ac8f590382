"""Graceful stop on SIGTERM / SIGINT: finish the step, checkpoint, exit 143 / 130.

What it replaces: Python's defaults, under which SIGTERM (a cluster scheduler's preemption, then
SIGKILL after a grace period) killed the run in 0.1 s printing nothing, and SIGINT printed a
KeyboardInterrupt traceback, possibly in the middle of a checkpoint write; everything since the
last periodic checkpoint was lost.

Contract:
- `install()` (main thread) replaces the SIGTERM and SIGINT handlers until `uninstall()`. The first
  signal only sets a flag and says what will happen; the running step, and a checkpoint being
  written, complete. A second signal aborts at once (`os._exit(128 + signum)`): a checkpoint being
  written stays under its `.tmp` name, every earlier one intact.
- `should_stop(steps_done, at_boundary)`: True at the first checkpoint boundary (`at_boundary`: the
  caller's checkpoint alignment) after a signal. With several ranks the decision is collective, so
  every rank stops at the same step: at each boundary the ranks all-reduce (MAX) their flags on the
  CPU (gloo) group, never the GPU stream. A rank that died makes that all-reduce fail like any other
  collective; the trainer names the lost rank (distributed.lost_ranks).
- `exit_code`: 143 for SIGTERM, 130 for SIGINT (128 + the signal number, as a shell reports it).

Why only at boundaries: a checkpoint is exact only where no gradient is held across the step
boundary (checkpoint.aligned); with the speedrun's cadences that is every second step, so a stop
takes the current step plus at most one more, then one save.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

from track_1_short.distributed import DistributedContext

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """Concern: turning SIGTERM / SIGINT into a stop at the next checkpoint boundary, agreed by
    every rank (the module docstring)."""

    def __init__(self, ctx: DistributedContext):
        self.ctx = ctx
        self.signum: int | None = None  # the first signal received
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> GracefulStop:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(f"\n{name} again: aborting now; checkpoints written before stay intact "
                  f"(one being written stays under its .tmp name)", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(f"\n{name} received: finishing the current step, then writing a checkpoint and "
              f"exiting ({128 + signum}); send it again to abort at once", file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "none"

    def should_stop(self, steps_done: int, at_boundary: bool) -> bool:
        """At a checkpoint boundary: has any rank received a signal? (collective there)."""
        if not at_boundary:
            return False
        if self.ctx.world_size == 1:
            return self.requested
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)  # CPU: the gloo group
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.health_group)
        if flag.item() and self.signum is None:
            self.signum = int(flag.item())  # another rank's signal: stop as it does
        return bool(flag.item())


class StoppedBeforeTraining(Exception):
    """A signal during the warmup: nothing trained, nothing to save (lifecycle.py exits)."""
