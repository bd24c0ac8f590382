"""Row prefetch: the n-gram row-id exchange of the next micro-batch, issued eagerly between this
micro-step's forward and backward replays so it hides under the backward.

What it replaces: HEAD modded-nanogpt's sparse bigram comms (facts 4.3: gloo all_to_all of counts
right after the batch is produced, NCCL all_to_all of the row ids between forward and backward, only
for world_size 8 and grad_accum 1). Here the same idea covers any world size and any number of
micro-steps, for the row pull of NgramStore (DESIGN section 2, "row_prefetch").

Two phases (perf/ngram_store.py's docstring has the exchange details):
- `issue(loader)`, phase A, after `runner.forward` and before `runner.backward`: takes the next
  micro-batch from the LookaheadLoader (which may belong to the next step), computes its row ids,
  their unique set, per-owner counts and the id all_to_all_single (NCCL on GPU, gloo on CPU). On
  CUDA all of it (the batch's H2D copies included) runs on a side stream: the count exchange needs
  one host sync, and on the compute stream that sync would wait for the forward replay just queued
  (the backward launch would then leave the GPU idle). It reads no table value, so an update event
  between issue and use cannot make it stale.
- `slots_for(inputs)`, phase B, right before that micro-batch's forward (so after the previous
  step's optimizer and update event): the owners send the rows, the cache is filled in place, the
  ngram_slots are returned. The row payload therefore always reflects every update event before it.
On one rank both are local (no collective); the interface and the returned (ids, slots) are the
same. Every rank must call issue/slots_for in the same order (they are collectives when W > 1).
With `rows_in_step` (one rank, TrainConfig.ngram_rows_in_step; NgramStore "Rows inside the
step") the step runner pulls the rows inside its forward: issue() then only takes the next batch
(its H2D copies on the side stream) and slots_for() hands it over and returns (None, None).

What must stay stable: nothing here is baked into a graph (the cache is the lookup's); a pending
request holds only ids. Ownership: the peeked batch's tensors are allocated on the side stream and
handed to the compute stream in slots_for (wait_stream + record_stream), after which the caller owns
them as it owns any BatchLoader batch.

Call order (train_step; one micro-step; the trainer uses LookaheadLoader to see the next batch):
    batch = loader.next_batch()
    ids, slots = prefetch.slots_for(batch.inputs)      # rows (phase B); phase A if none pending
    loss = runner.forward(step, batch, slots, cfg, micro_step=m)
    prefetch.issue(loader)                             # ids of the next micro-batch (phase A),
                                                       # hides under the forward/backward replays
    ngram_grad = runner.backward()
    ngram.hold(ngram_grad, ids)
  after the last micro-step: optimizer.step(...); if event: ngram.update_event(step, lr_mul)

Provenance: facts 4.3 (HEAD, @classiclarryd's sparse bigram comms); our design, DESIGN.md section 4.
Deviations: no CPU bitmap of touched rows (torch.unique on the device instead); the counts go
through the same backend as the ids (on CUDA a side stream, so only that stream syncs).
Legend: T tokens of a micro-batch.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch
from torch import Tensor

from track_1_short.perf.ngram_store import NgramStore, RowRequest


class LookaheadLoader:
    """Wraps a BatchLoader so the trainer can see the next micro-batch before its turn: peek()
    takes it from the loader once, next_batch() returns it (or the loader's next one). The batch
    tensors are fresh allocations owned by the caller (BatchLoader contract), so holding one early
    is safe. state_dict() is the resume point as if nothing had been peeked (a peeked batch is
    handed out again by a resumed loader), so checkpoints stay exact."""

    def __init__(self, loader):
        self.loader = loader
        self._next = None
        self._state_before_peek: dict | None = None

    def peek(self):
        if self._next is None:
            # resume point before the peek (loaders without state, e.g. benchmarks', have none)
            has_state = hasattr(self.loader, "state_dict")
            self._state_before_peek = self.loader.state_dict() if has_state else None
            self._next = self.loader.next_batch()
        return self._next

    def next_batch(self):
        batch, self._next = self._next, None
        return batch if batch is not None else self.loader.next_batch()

    def state_dict(self) -> dict:
        return dict(self._state_before_peek) if self._next is not None else self.loader.state_dict()

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    def close(self) -> None:
        self.loader.close()


def _tensors(batch) -> list[Tensor]:
    if dataclasses.is_dataclass(batch):
        return [v for v in (getattr(batch, f.name) for f in dataclasses.fields(batch))
                if isinstance(v, Tensor)]
    return [batch.inputs]


class RowPrefetch:
    """Holds at most one pending phase-A request: the next micro-batch's ids (and their exchange)."""

    def __init__(self, table: NgramStore, rows_in_step: bool = False):
        """rows_in_step: the step runner pulls the rows (NgramStore.pull_, one rank only)."""
        if rows_in_step and not table.rows_in_step:
            raise ValueError(f"RowPrefetch(rows_in_step=True) needs one rank; the table is sharded "
                             f"over {table.world_size}")
        self.table = table
        self.rows_in_step = rows_in_step
        self.stream = None  # CUDA side stream of phase A (made on first CUDA use)
        self._pending: tuple[object, Tensor, RowRequest | None] | None = None  # (batch, ids [2T], req)

    @property
    def active(self) -> bool:
        """False on one rank: issue() then only takes the batch and computes its ids early."""
        return self.table.world_size > 1

    def _side(self):
        device = self.table.lookup.cache.device
        if device.type != "cuda":
            return nullcontext()
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        # No wait on the compute stream: phase A reads only the new batch (copied on this stream)
        # and writes no buffer a replay reads; the cache is written in slots_for, on the compute stream.
        return torch.cuda.stream(self.stream)

    def issue(self, loader: LookaheadLoader):
        """Phase A for loader's next micro-batch (collective when W > 1); returns that batch
        (owned by the loader until its next_batch() hands it out)."""
        if self._pending is not None:
            raise RuntimeError("RowPrefetch.issue: the previous request was never used by slots_for")
        with self._side():
            batch = loader.peek()  # H2D copies on the side stream
            if self.rows_in_step:  # the runner computes the ids inside its forward
                self._pending = (batch, None, None)
                return batch
            ids = self.table.lookup.row_ids(batch.inputs)  # [2T]
            self._pending = (batch, ids, self.table.request_rows(ids))
        return batch

    def _hand_over(self, batch, ids: Tensor | None, request: RowRequest | None) -> None:
        """Side-stream tensors become usable (and safely freeable) on the compute stream."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(batch.inputs.device)
        current.wait_stream(self.stream)
        extra = [] if request is None else [request.wanted, request.inverse, request.served]
        for t in _tensors(batch) + ([] if ids is None else [ids]) + extra:
            t.record_stream(current)

    def slots_for(self, inputs: Tensor) -> tuple[Tensor, Tensor] | tuple[None, None]:
        """Phase B (collective when W > 1): fill the cache with `inputs`' rows; returns (ids [2T],
        ngram_slots [2T]). Uses the pending request when it was issued for this very tensor.
        rows_in_step: hands the batch over only and returns (None, None) (the runner pulls)."""
        pending, self._pending = self._pending, None
        if pending is None:
            if self.rows_in_step:
                return None, None
            ids = self.table.lookup.row_ids(inputs)
            return ids, self.table.slots_for(inputs, ids)
        batch, ids, request = pending
        if batch.inputs is not inputs:
            raise RuntimeError("RowPrefetch.slots_for: a request is pending for another batch; "
                               "issue() must peek the batch the next slots_for uses")
        self._hand_over(batch, ids, request)
        if self.rows_in_step:
            return None, None
        return ids, self.table.slots_for(inputs, ids, request)

    def reset(self) -> None:
        """Drop a pending request (ids only; no collective is left half done). Call when the
        loader is replaced (end of warmup), else the next slots_for sees another batch."""
        self._pending = None
