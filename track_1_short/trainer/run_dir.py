"""The run directory: one live process per dir, never two runs mixed in one, atomic cleanup.

What it replaces: `runs/<run_id>/` created by whoever wrote first (the metrics log's mkdir), which
let a second run with the same id overwrite the first one's config, summary, plots and checkpoints
and append to its `metrics.jsonl` (two runs mixed, found only later), and let two live processes
share one dir.

Contract (`claim_run_dir`, rank 0 only; other ranks write only DCP shards into checkpoint dirs
rank 0 names):
- a new run id: the dir is created; an existing one is refused (RunDirError naming the dir and
  the fixes: `--overwrite`, `--resume DIR`, another `--run-id`) unless
  - `overwrite`: everything in the dir is removed (after the lock is held), then the run starts
    clean;
  - `resume_in_place`: the run continues there (`--resume` of a checkpoint of this dir); records
    of steps after the checkpoint are dropped from `metrics.jsonl` (rewritten atomically), so the
    resumed run's records follow the checkpoint's without a duplicate or a stale step.
- a lock: `<dir>/.lock` held with `fcntl.flock` for the life of the process (the kernel drops it
  when the process dies, kill -9 included, so a crashed run never blocks its own resume). A second
  live process on the same dir is refused, naming the holder's pid.
- `RunDir.release(remove=...)`: drops the lock; `remove=True` deletes a dir this process created
  (an error found before the first timed step leaves no run dir behind).

What a killed checkpoint save left (`ckpt_*.tmp`, `.old`, `.del`; checkpoint.py) is cleaned up
under the lock at claim (`checkpoint.recover_checkpoints`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from track_1_short.trainer.checkpoint import recover_checkpoints

LOCK_NAME = ".lock"
METRICS_NAME = "metrics.jsonl"


class RunDirError(ValueError):
    """A run dir that cannot be used; the message names it and what to pass instead."""


@dataclass(slots=True)
class RunDir:
    """Concern: one claimed run dir (its lock, and whether this process created it)."""

    path: Path
    created: bool  # this process made the dir (release(remove=True) may delete it)
    lock_file: IO | None

    def release(self, remove: bool = False) -> None:
        """Drop the lock; with `remove`, delete the dir if this process created it."""
        if self.lock_file is not None:
            fcntl.flock(self.lock_file, fcntl.LOCK_UN)
            self.lock_file.close()
            self.lock_file = None
        if remove and self.created:
            shutil.rmtree(self.path, ignore_errors=True)


def _lock(path: Path) -> IO:
    f = open(path / LOCK_NAME, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RunDirError(f"run dir {path} is in use by another live process (pid {holder}, lock "
                          f"{path / LOCK_NAME}); wait for it to finish or pass another --run-id")
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _clear(path: Path) -> None:
    """Remove everything in the dir except the lock this process holds."""
    for child in path.iterdir():
        if child.name == LOCK_NAME:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def truncate_metrics(path: Path, steps_done: int) -> int:
    """Keep only records of steps before `steps_done` in metrics.jsonl (the resumed run logs
    step `steps_done`'s validation and every later record again), rewritten atomically; returns
    the number of records dropped."""
    metrics = path / METRICS_NAME
    if not metrics.is_file():
        return 0
    kept, dropped = [], 0
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        if json.loads(line).get("step", 0) < steps_done:
            kept.append(line)
        else:
            dropped += 1
    tmp = metrics.with_name(METRICS_NAME + f".tmp{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, metrics)
    return dropped


def claim_run_dir(path: Path, *, overwrite: bool = False, resume_in_place: bool = False) -> RunDir:
    """Create (or, with a flag, reuse) and lock the run dir; see the module docstring."""
    if overwrite and resume_in_place:
        raise RunDirError(f"--overwrite with --resume of a checkpoint in {path}: overwriting would "
                          f"delete the checkpoint; drop one of them")
    existed = path.exists()
    if existed and not path.is_dir():
        raise RunDirError(f"run dir {path} exists and is not a directory; pass another --run-id")
    if existed and not (overwrite or resume_in_place):
        raise RunDirError(f"run dir {path} already exists (a run with this id ran before); pass "
                          f"--overwrite to start it clean, --resume {path} to continue it, or "
                          f"another --run-id")
    path.mkdir(parents=True, exist_ok=True)
    run_dir = RunDir(path=path, created=not existed, lock_file=_lock(path))
    try:
        if overwrite and existed:
            _clear(path)
        recover_checkpoints(path)
    except BaseException:
        run_dir.release()
        raise
    return run_dir
