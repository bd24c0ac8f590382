"""The post-warmup in-place reset: a host snapshot of the initial state, copied back in place.

What it is for: the warmup trains real steps (captures, self-checks, every cadence), so the timed
run must start again from the initial state, and it must do so without moving any tensor a step
graph baked. `snapshot_state` clones every parameter and buffer to host memory before the warmup;
`restore_state` copies them back in place and resets the optimizer, the n-gram table, YaRN and the
fp8 scales, so the timed run starts from exactly the initial state. The census around it
(perf/cuda_graphs/baked_addresses.py) proves no baked address moved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from track_1_short.trainer.state import StepParts


@torch.no_grad()
def snapshot_state(parts: StepParts) -> dict:
    """Host copies of every parameter and buffer (taken before the warmup touches anything)."""
    model = parts.model
    return {"params": {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()},
            "buffers": {n: b.detach().to("cpu", copy=True) for n, b in model.named_buffers()}}


@torch.no_grad()
def restore_state(parts: StepParts, snap: dict) -> None:
    """Copy the snapshot back in place and reset every stateful component (no reallocation)."""
    model = parts.model
    for name, p in model.named_parameters():
        p.copy_(snap["params"][name])
        p.grad = None
    model.ngram_table.reset()  # the lookup: row cache and sinks
    parts.ngram.reset()  # the store: the table slice, its Adam state, held gradients
    model.reset_yarn()
    for name, b in model.named_buffers():
        if name in snap["buffers"]:
            b.copy_(snap["buffers"][name])
    parts.optimizer.reset()
