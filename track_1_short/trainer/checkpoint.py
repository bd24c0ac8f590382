"""Checkpoints on disk (torch.distributed.checkpoint): atomic swap, whole-checkpoint validation.

What it replaces: a save that deleted the old folder (`shutil.rmtree`) and then renamed the new
one over it, so a kill during the delete left `ckpt_step000040/` with `.metadata` and
`trainer.json` but no data file (found twice by kill -9 on cpu-tiny), and a resume that ended in
a 58-line FileNotFoundError or a CheckpointException naming no path.

Layout of one checkpoint, `<run_dir>/ckpt_step<NNNNNN>/`: a DCP checkpoint (`.metadata` plus each
rank's `__<rank>_*.distcp`) of the state dict the caller passes (the trainer's: "model" replicated,
"optim_rank<r>" and "ngram_rank<r>" per rank), plus `trainer.json` (rank 0): steps_done,
world_size, micro_steps, the loader position, the val curve, the train clock, the preset.

Write protocol (`save_checkpoint`; every rank calls it, rank 0 renames):
  1. everything goes to `ckpt_stepN.tmp` (a stale one is deleted first); DCP writes `.metadata`
     after every rank's data; rank 0 then writes `trainer.json`, fsyncs the folder's files;
  2. the swap: if `ckpt_stepN` exists, rename it aside to `ckpt_stepN.old`; rename the `.tmp` in;
     rename the `.old` to `.del` and delete that.
Each rename is atomic, so at every instant a complete copy of the newest save is under a name
`find_latest` accepts (`ckpt_stepN`, or `ckpt_stepN.old` between the two renames of a swap), and
nothing incomplete is: `.tmp` and `.del` are never resumable, and a folder is only ever deleted
under the `.del` name. `recover_checkpoints` (run at claim, under the run dir's lock) renames an
orphaned `.old` back and deletes the rest. A step is never saved twice by one run (the caller
skips a save of the step it saved last, e.g. the final save right after a periodic one).

Validation (`validate_checkpoint`, before anything is built): `trainer.json` parses and has its
keys, `.metadata` reads, and every storage file it lists exists and is at least as long as the
last byte it points at. A bad checkpoint is a CheckpointError naming the file and the fix.

Alignment (`aligned`): a checkpoint is only taken where nothing is held across the step boundary,
read from the schedule's plan of the step before it (StepPlan.nothing_held): after an Adam step
(Adam's accumulator is consumed) that is also an n-gram update event (no held sink gradients).
Those boundaries are the multiples of the schedule's `checkpoint_period` (lcm of the two cadences,
which --save-every must be a multiple of), plus the run's end when the last step's forced event
falls on an Adam step.

Loading copies into the existing tensors (DCP loads in place), so no address a step graph baked
moves. Optimizer shards load on the same world size only.

The trainer's state (`save_run` / `resume_run`, from the spec, the step parts and the progress):
"model" (every parameter and persistent buffer, replicated: YaRN tables, fp8 scales, the prefix
table, the n-gram sign buffer), "optim_rank<r>" (rank r's optimizer shards) and "ngram_rank<r>"
(rank r's n-gram rows, their Adam state and update count: perf/ngram_store.py; on one rank, the
whole table).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from tqdm import tqdm

if TYPE_CHECKING:
    from track_1_short.schedule import StepPlan
    from track_1_short.trainer.state import Progress, RunSpec, StepParts

PREFIX = "ckpt_step"
TRAINER_JSON = "trainer.json"
TRAINER_KEYS = ("steps_done", "world_size", "micro_steps", "loader", "val_curve", "train_time_s")
_NAME = re.compile(rf"^{PREFIX}(\d{{6,}})(\.old)?$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or resumed from; the message names the path."""


@dataclass(slots=True, frozen=True)
class CheckpointInfo:
    """A validated checkpoint: its folder, step count and trainer.json."""

    path: Path
    steps_done: int
    meta: dict


def checkpoint_path(run_dir: Path, steps_done: int) -> Path:
    return run_dir / f"{PREFIX}{steps_done:06d}"


# ---------------------------------------------------------------- validation

def validate_checkpoint(path: Path) -> CheckpointInfo:
    """Check a checkpoint folder whole (module docstring); CheckpointError names what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"--resume {path}: no such checkpoint folder")
    meta_path = path / TRAINER_JSON
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"--resume {path}: no {TRAINER_JSON} (not a checkpoint of this "
                              f"trainer, or an incomplete one); resume from another checkpoint")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--resume {meta_path}: unreadable ({e}); the checkpoint is damaged, "
                              f"resume from another one")
    missing = [k for k in TRAINER_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"--resume {meta_path}: missing {missing}; the checkpoint is damaged "
                              f"or from another version, resume from another one")
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # DCP raises FileNotFoundError, pickle and EOF errors: all mean damaged
        raise CheckpointError(f"--resume {path / '.metadata'}: cannot read the DCP metadata "
                              f"({type(e).__name__}: {e}); resume from another checkpoint")
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"--resume {path}: data file {name} is missing (listed in "
                                  f".metadata); the checkpoint is incomplete, resume from another one")
        if file.stat().st_size < size:
            raise CheckpointError(f"--resume {file}: {file.stat().st_size} bytes, .metadata needs at "
                                  f"least {size}; the file is truncated, resume from another checkpoint")
    return CheckpointInfo(path=path, steps_done=int(meta["steps_done"]), meta=meta)


def _candidates(run_dir: Path) -> list[tuple[int, Path]]:
    out = []
    for p in run_dir.iterdir() if run_dir.is_dir() else ():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out, key=lambda sp: (sp[0], sp[1].suffix != ".old"))


def find_latest(run_dir: Path) -> CheckpointInfo | None:
    """The newest checkpoint of a run dir that validates (None if there is none)."""
    for _, path in reversed(_candidates(run_dir)):
        try:
            return validate_checkpoint(path)
        except CheckpointError:
            continue
    return None


def resolve_resume(path: Path) -> CheckpointInfo:
    """`--resume PATH`: a checkpoint folder, or a run dir (its newest complete checkpoint)."""
    path = Path(path)
    if (path / TRAINER_JSON).exists() or (path / ".metadata").exists() or _NAME.match(path.name):
        return validate_checkpoint(path)
    if not path.is_dir():
        raise CheckpointError(f"--resume {path}: no such checkpoint or run dir")
    latest = find_latest(path)
    if latest is None:
        found = [p.name for _, p in _candidates(path)]
        raise CheckpointError(f"--resume {path}: no complete checkpoint in this run dir (found "
                              f"{found or 'none'}); pass a checkpoint folder or another run dir")
    return latest


def recover_checkpoints(run_dir: Path) -> None:
    """Under the run dir's lock: an orphaned `.old` (killed between the swap's two renames) is
    the newest complete copy of its step, so it goes back to its name; everything else a killed
    save left (`.tmp`, `.del`, a superseded `.old`) is deleted."""
    for path in run_dir.glob(f"{PREFIX}*"):
        if not path.is_dir():
            continue
        if path.suffix == ".old":
            final = path.with_suffix("")
            if not final.exists():
                os.replace(path, final)
                continue
        if path.suffix in (".old", ".tmp", ".del"):
            _delete(path)


def _delete(path: Path) -> None:
    """Delete a checkpoint folder, first renamed to `<name>.del` (so a kill mid-delete never
    leaves a partial folder under a resumable name)."""
    gone = path.with_suffix(".del")  # ckpt_step000040[.old|.tmp] -> ckpt_step000040.del
    if gone != path:
        if gone.exists():
            shutil.rmtree(gone)
        os.replace(path, gone)
    shutil.rmtree(gone)


# ---------------------------------------------------------------- save / load

def aligned(plans: Sequence[StepPlan], steps_done: int) -> bool:
    """True when nothing is held across the boundary after `steps_done` steps: the plan of the
    last step done says so (plans: the run's, indexed by step; 0 steps done holds nothing)."""
    return steps_done == 0 or plans[steps_done - 1].nothing_held


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_tree(path: Path) -> None:
    for file in path.iterdir():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_in(tmp: Path, final: Path) -> None:
    """Rank 0: the complete `tmp` becomes `final` (module docstring, step 2)."""
    old = final.with_suffix(".old")
    if old.exists():
        _delete(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        _delete(old)


def save_checkpoint(run_dir: Path, steps_done: int, state: dict, trainer_meta: dict, *,
                    is_main: bool) -> Path:
    """Write `state` (a DCP state dict, this rank's part) and, on rank 0, `trainer_meta` as
    ckpt_step<steps_done>; collective (every rank calls it). Returns the checkpoint's path."""
    final = checkpoint_path(run_dir, steps_done)
    tmp = final.with_suffix(".tmp")
    if is_main and tmp.exists():
        _delete(tmp)
    _barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if is_main:
        meta_tmp = tmp / (TRAINER_JSON + ".tmp")
        meta_tmp.write_text(json.dumps({"steps_done": steps_done, **trainer_meta}, indent=1,
                                       default=str))
        os.replace(meta_tmp, tmp / TRAINER_JSON)
        _fsync_tree(tmp)
    _barrier()
    if is_main:
        swap_in(tmp, final)
        _fsync_tree(run_dir)
    _barrier()
    return final


def load_checkpoint(info: CheckpointInfo, state: dict) -> None:
    """Load a validated checkpoint into `state` in place (collective)."""
    try:
        dcp.load(state, checkpoint_id=str(info.path))
    except Exception as e:  # CheckpointException wraps the per-rank errors (EOF, missing keys)
        raise CheckpointError(f"--resume {info.path}: cannot load ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}); the "
                              f"checkpoint is damaged or from another model config, resume from "
                              f"another one") from e


# ---------------------------------------------------------------- the trainer's state

def training_state(spec: RunSpec, parts: StepParts) -> dict:
    """The DCP state dict: the model's parameters and buffers, replicated, under "model"; this
    rank's optimizer shards and n-gram rows (table, Adam moments, update count) under its keys."""
    rank = spec.ctx.rank
    return {f"optim_rank{rank}": parts.optimizer.state_dict(),
            f"ngram_rank{rank}": parts.ngram.state_dict(), "model": parts.model.state_dict()}


def save_run(spec: RunSpec, parts: StepParts, progress: Progress, steps_done: int) -> Path | None:
    """ckpt_step<steps_done> of the run dir (collective). A step this run saved last is not written
    again (the final save right after a periodic one); None, said on its own line, where no exact
    checkpoint can be taken (an unaligned final step)."""
    path = checkpoint_path(spec.run_dir, steps_done)
    if steps_done == progress.last_saved_step:
        return path
    if not aligned(spec.plans, steps_done):
        if spec.ctx.is_main:
            tqdm.write(f"checkpoint after step {steps_done} skipped: checkpoints are exact only every "
                       f"{spec.checkpoint_period} steps (no Adam or n-gram gradient held across)")
        return None
    meta = {"world_size": spec.ctx.world_size, "micro_steps": spec.micro_steps,
            "loader": progress.loader.state_dict() if progress.loader else None,
            "val_curve": progress.val_curve, "train_time_s": progress.train_time_s,
            "preset": spec.cfg.preset}
    save_checkpoint(spec.run_dir, steps_done, training_state(spec, parts), meta,
                    is_main=spec.ctx.is_main)
    progress.last_saved_step = steps_done
    if spec.ctx.is_main:
        tqdm.write(f"checkpoint {path}")
    return path


def resume_run(spec: RunSpec, parts: StepParts, progress: Progress, info: CheckpointInfo) -> dict:
    """Load a validated checkpoint in place into the parts and the progress; returns the loader
    state to resume from (the caller builds the loader)."""
    state = training_state(spec, parts)
    load_checkpoint(info, state)
    parts.optimizer.load_state_dict(state[f"optim_rank{spec.ctx.rank}"])
    steps_done = progress.steps_done = info.steps_done
    # YaRN tables and scales as they stand after `steps_done` steps (the Python float scales are
    # not in the checkpoint: the window moves are replayed in order from the base tables)
    parts.model.reset_yarn()
    for step in range(steps_done):  # a move at step `steps_done` is train_step's to make
        parts.model.set_yarn_window(spec.schedule.plan(step).ws_long)
    progress.val_curve = list(info.meta["val_curve"])
    progress.train_time_s = float(info.meta["train_time_s"])
    if info.path.parent.resolve() == spec.run_dir.resolve():
        progress.last_saved_step = steps_done  # continuing in place: that checkpoint is this run's
    if spec.ctx.is_main:
        print(f"resumed from {info.path} at step {steps_done}", flush=True)
    return info.meta["loader"]
