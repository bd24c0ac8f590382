"""Checkpoints (torch.distributed.checkpoint) and the post-warmup in-place state snapshot.

Checkpoint layout: a directory `<run_dir>/ckpt_step<NNNNNN>/` holding a DCP checkpoint of
  "model"            every parameter and persistent buffer (n-gram table + its Adam state, YaRN
                     tables, fp8 scales, prefix table); replicated, so any world size can load it
  "optim_rank<r>"    rank r's optimizer shards (AnvilAndAdam.state_dict(): each rank its own)
  "ngram_rank<r>"    rank r's n-gram table rows and their Adam state (only when sharded)
plus `trainer.json` (rank 0): step, loader position, the schedule position, val curve, train time.
Visibility: everything is written to `<dir>.tmp`; rank 0 renames it once every rank's DCP files and
the metadata are complete, so a half-written checkpoint never looks valid (config.py's --resume
check requires the final `.metadata`).

Exact resume: a checkpoint is only taken at a step boundary where nothing is held across steps:
after an Adam step (Adam's two-step gradient accumulator is empty) and after an n-gram update
event (no held sink gradients). `aligned(step)` says where; save_checkpoint refuses elsewhere.
Loading copies into the existing tensors (DCP loads in place), so no address a step graph baked
moves. Optimizer shards load on the same world size only (each rank's slice of the banks).

Snapshot/restore (warmup): `snapshot_state` clones every parameter and buffer to host memory before
the warmup; `restore_state` copies them back in place and resets the optimizer, the n-gram table,
YaRN and the fp8 scales, so the timed run starts from exactly the initial state.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from track_1_short.report import write_json_atomic

if TYPE_CHECKING:
    from track_1_short.train import Run


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or resumed from; the message names the path."""


def aligned(run: "Run", steps_done: int) -> bool:
    """True when no gradient is held across the boundary after `steps_done` steps."""
    period = math.lcm(run.cfg.optim.adam_every, run.cfg.schedule.ngram_cycle)
    return steps_done % period == 0


def _barrier(run: "Run") -> None:
    if run.ctx.world_size > 1:
        dist.barrier()


def save_checkpoint(run: "Run", steps_done: int) -> Path | None:
    """Write ckpt_step<steps_done>; returns its path (None, with a message, when not aligned)."""
    final = run.run_dir / f"ckpt_step{steps_done:06d}"
    if not aligned(run, steps_done):
        if run.ctx.is_main:
            print(f"checkpoint at step {steps_done} skipped: an Adam or n-gram gradient is held "
                  f"across this boundary (checkpoint at multiples of "
                  f"lcm(adam_every, ngram_cycle))", flush=True)
        return None
    tmp = final.with_name(final.name + ".tmp")
    if run.ctx.is_main and tmp.exists():
        shutil.rmtree(tmp)
    _barrier(run)
    dcp.save(_dcp_state(run), checkpoint_id=str(tmp))
    if run.ctx.is_main:
        write_json_atomic(tmp / "trainer.json", {
            "steps_done": steps_done, "world_size": run.ctx.world_size,
            "micro_steps": run.micro_steps, "loader": run.loader.state_dict() if run.loader else None,
            "val_curve": run.val_curve, "train_time_s": run.train_time_s, "preset": run.cfg.preset})
    _barrier(run)
    if run.ctx.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        print(f"checkpoint {final}", flush=True)
    _barrier(run)
    return final


SHARDED_BUFFERS = ("ngram_table.table", "ngram_table.exp_avg", "ngram_table.exp_avg_sq")


def _dcp_state(run: "Run") -> dict:
    """The DCP state dict: replicated model state under "model", each rank's shards under its own
    keys (optimizer state; the n-gram table's row slice and its Adam state when sharded)."""
    model = run.model.state_dict()
    rank = run.ctx.rank
    state = {f"optim_rank{rank}": run.optimizer.state_dict()}
    if run.ctx.world_size > 1:
        state[f"ngram_rank{rank}"] = {k: model.pop(k) for k in SHARDED_BUFFERS}
    state["model"] = model
    return state


def load_checkpoint(run: "Run", path: Path) -> int:
    """Load in place; returns the number of steps already done (the first step to run)."""
    meta_path = path / "trainer.json"
    if not meta_path.is_file():
        raise CheckpointError(f"--resume {path}: no trainer.json (not written by this trainer, or "
                              f"incomplete)")
    meta = json.loads(meta_path.read_text())
    if meta["world_size"] != run.ctx.world_size:
        raise CheckpointError(f"--resume {path}: saved on {meta['world_size']} ranks, running on "
                              f"{run.ctx.world_size}; the optimizer shards load on the same world size")
    state = _dcp_state(run)
    dcp.load(state, checkpoint_id=str(path))
    run.optimizer.load_state_dict(state[f"optim_rank{run.ctx.rank}"])
    steps_done = int(meta["steps_done"])
    _advance_schedule_state(run, steps_done)
    run.val_curve = list(meta["val_curve"])
    run.train_time_s = float(meta["train_time_s"])
    from track_1_short.train import make_loader  # the trainer owns loader construction

    run.loader = make_loader(run, state=meta["loader"])
    if run.ctx.is_main:
        print(f"resumed from {path} at step {steps_done}", flush=True)
    return steps_done


def _advance_schedule_state(run: "Run", steps_done: int) -> None:
    """YaRN tables and scales as they stand after `steps_done` steps (the Python float scales are
    not in the checkpoint: the window moves are replayed in order from the base tables)."""
    run.model.reset_yarn()
    for step in range(steps_done):  # a move at step `steps_done` is train_step's to make
        run.model.set_yarn_window(run.schedule.plan(step).ws_long)


@torch.no_grad()
def snapshot_state(run: "Run") -> dict:
    """Host copies of every parameter and buffer (taken before the warmup touches anything)."""
    return {"params": {n: p.detach().to("cpu", copy=True) for n, p in run.model.named_parameters()},
            "buffers": {n: b.detach().to("cpu", copy=True) for n, b in run.model.named_buffers()}}


@torch.no_grad()
def restore_state(run: "Run", snap: dict) -> None:
    """Copy the snapshot back in place and reset every stateful component (no reallocation)."""
    model = run.model
    for name, p in model.named_parameters():
        p.copy_(snap["params"][name])
        p.grad = None
    model.ngram_table.reset()
    model.reset_yarn()
    for name, b in model.named_buffers():
        if name in snap["buffers"]:
            b.copy_(snap["buffers"][name])
    run.optimizer.reset()
