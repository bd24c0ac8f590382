"""One training step and one validation pass: the code every phase (warmup, timed, resumed) runs.

What it replaces: modded-nanogpt's micro-step written twice (warmup and timed, train_gpt.py
:2285-2293 and :2357-2364). Here `train_step` is the one definition; graphs on or off differ only
in the step runner (StepGraphs or EagerStep, same interface).

Call order per step (train_step): YaRN window (moves only where ws_long changes) -> per micro-step:
loader batch -> n-gram slots -> runner.forward -> next micro-batch's row-id exchange (hidden
under the backward) -> runner.backward -> hold the n-gram gradient (on one rank the runner pulls
and holds the rows itself, inside the step graphs: the slots and the gradient are then None and
the hold only counts; perf/ngram_store.py "Rows inside the step") -> optimizer.step (ANVIL
every step, Adam on the plan's adam_step steps) -> embed/head untie (once) -> n-gram update event
(the plan's ngram_event steps). Every cadence is the step's StepPlan's (schedule.py).
The timer marks the end of each phase (timing.StepTimer: per micro-step rows, forward, backward,
hold; then optimizer, ngram_update).
"""

from __future__ import annotations

import torch
from torch import Tensor

from track_1_short.data import num_val_slices, val_batches
from track_1_short.perf.row_prefetch import LookaheadLoader
from track_1_short.trainer.state import RunSpec, StepParts
from track_1_short.trainer.timing import StepTimer


def train_step(spec: RunSpec, parts: StepParts, step: int, loader: LookaheadLoader,
               timer: StepTimer) -> Tensor:
    """One optimizer step over `micro_steps` micro-batches; returns the mean per-token loss (0-d,
    on the device, owned by the caller). Each micro-step's loss is its sum / micro_steps. The
    step's one-time transitions (YaRN window, embed/head untie) follow the model's and optimizer's
    state, so the warmup may run a step twice or jump over a stage's first step."""
    plan, model, runner = spec.plans[step], parts.model, parts.runner
    model.set_yarn_window(plan.ws_long)  # at a ws_long change: YaRN tables in place, scales move
    ngram, fwd_cfg = parts.ngram, spec.fwd_cfgs[step]
    total = torch.zeros((), device=spec.ctx.device)
    for micro in range(spec.micro_steps):
        batch = loader.next_batch()
        # n-gram rows of this micro-batch from their owners (after the last update event); None,
        # None when the runner pulls them inside the step
        ids, slots = parts.prefetch.slots_for(batch.inputs)  # [2T] table rows, [2T] cache slots
        timer.mark(step, "rows")
        loss = runner.forward(step, batch, slots, fwd_cfg, micro_step=micro)
        total += loss  # loss may be graph memory: accumulate before the next replay
        timer.mark(step, "forward")
        parts.prefetch.issue(loader)  # next micro-batch's row-id exchange, hidden under the backward
        ngram_grad = runner.backward()
        timer.mark(step, "backward")
        ngram.hold(ngram_grad, ids)  # summed into the store's row accumulator before the next replay
        timer.mark(step, "hold")
    # ANVIL reduce-scatters read p.grad (graph buffers) before the next step's backward replay.
    parts.optimizer.step(step, plan.lr_mul, plan.momentum, plan.adam_step)
    if step == spec.untie_step and parts.optimizer.tied:
        parts.optimizer.untie_embed_head()  # embed's Adam state <- lm_head's (collective)
    timer.mark(step, "optimizer")
    if plan.ngram_event:
        ngram.update_event(step, plan.lr_mul)  # sparse Adam on the held rows, cache refreshed
        timer.mark(step, "ngram_update")
    return (total / plan.tokens_per_rank).detach()


@torch.no_grad()
def evaluate(spec: RunSpec, parts: StepParts, val_tokens, ws_short: int, ws_long: int) -> float:
    """Mean per-token CE over the validation tokens (every rank's slices, reduced)."""
    dcfg, ctx = spec.cfg.data, spec.ctx
    T = dcfg.val_tokens_per_batch  # the preflight checked that every rank gets a batch
    ngram = parts.ngram
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    count = torch.zeros((), dtype=torch.float64, device=ctx.device)
    batches = list(val_batches(val_tokens, T, dcfg.val_cu_seqlens_rows, ctx.rank, ctx.world_size,
                               ctx.device))
    # Every rank runs the same number of forwards (the n-gram row pull is a collective); a rank
    # with fewer slices repeats its last one without counting it.
    rounds = -(-num_val_slices(val_tokens.size, T) // ctx.world_size)
    for i in range(rounds):
        batch = batches[min(i, len(batches) - 1)]
        slots = ngram.slots_for(batch.inputs)
        ce = parts.eval_fn(batch.inputs, batch.targets, batch.cum_seqlens, slots, ws_short, ws_long, T)
        if i < len(batches):
            loss_sum += ce.double().sum()
            count += ce.numel()
    if ctx.world_size > 1:
        stats = torch.stack([loss_sum, count])
        torch.distributed.all_reduce(stats)
        loss_sum, count = stats[0], stats[1]
    return float(loss_sum / count)
