"""CUDA graphs of the training step's forward and backward: one captured pair per StepGraphKey.

What it replaces: running the compiled model eagerly every step, which launches ~650 kernels + 69
memsets in the forward call and ~73 in backward() per stage-A micro-step from Python, at ~21 ms
of host time against ~28 ms of GPU time (facts section 8, one H200, torch 2.11): near host-bound
at stage A with 8 ranks. Why it is faster: a replay launches the whole forward (or backward) as
one graph, so the host cost per step drops to a handful of copies and two replays, and the host
runs ahead of the device. Record #360 measured ~3.0 s over the run for this and its other graphs.

What is captured, per key (capture_plan.StepGraphKey: shapes and Python values the compiled model
specializes on):
    forward   step_runner.training_loss(): the model's per-token loss, summed
    backward  capture_support.loss_grads(): gradients w.r.t. every parameter and the n-gram sink
Between the two replays the host runs the eager row-pull id exchange (perf/row_prefetch.py), so the
all_to_all hides under the backward exactly as it does without graphs. On one rank, where the row
pull is no collective (`ngram_store` given: NgramStore "Rows inside the step"), the forward graph
starts with the pull (row ids, cache rows and slots from the static inputs, NgramStore.pull_) and
the backward graph ends with the held gradient's sum (NgramStore.accumulate_), so a micro-step
runs no eager n-gram kernel.

What must stay address-stable (a replay reads and writes the addresses the capture saw):
- the per-key StaticInputs owned here: inputs, targets, cum_seqlens, n-gram cache slots, MTP and
  prefix weights; each step copies its batch into them before the forward replay (the slots and
  the row ids: written by the forward graph itself with rows in the step)
- with rows in the step, the store's table, row accumulator and touched flags (NgramStore.baked_tensors)
- every parameter's .data and every model buffer (fp8 scales, YaRN tables, n-gram row
  cache, prefix table), the n-gram sink leaves (NgramTable.grad_sink / .sinks, the model's
  lookup), value_embeds' gradient buffer (ValueEmbedPull.grad_accum), the token embedding's
  (GPT.embed_grad_accum, TrainConfig.embed_grad "pull"), and the persistent gradient accumulators (grad_handoff.py) owned here.
baked_addresses.py censuses all of them (baked_tensors() reads them live from their owners) before
and after the post-warmup reset. Python values the capture froze: the key (checked against the
schedule at every forward) and the three YaRN attention scales (re-checked at every replay).

Gradients: the captured backward writes each gradient into its own pool buffer, rewritten by the
next replay of that key; no AccumulateGrad runs. GradHandoff (grad_handoff.py, shared with the
eager twin) sets p.grad from them: ANVIL banks take the graph's buffer, Adam parameters (and
ANVIL banks under gradient accumulation) a persistent accumulator, copied or added by the
schedule's plan (StepPlan.adam_first, the plans given at construction). The n-gram sink gradient
is the graph's buffer too: the store adds it into its row accumulator right after backward()
(NgramStore.hold), before the next replay rewrites it, so nothing is copied or kept here.

Call order per micro-step: step_runner.py (StepGraphs and EagerStep, eager_step.py, are both a
StepRunner). After warmup: post-warmup reset, census compared, runner.seal().

Capture protocol: the first warmup visit of a key runs WARM_ITERATIONS eager iterations on the side
stream and captures both graphs (capture_support), then replays the forward; the second visit
replays both and compares the loss with an eager forward and every gradient with an eager backward
on the same buffers (an op that is not capture-safe can replay a right loss and wrong gradients),
the pulled ones too: what the replay added into value_embeds' and the token embedding's gradient
buffers against what the eager backward adds (then taken back out).
The eager forward runs with grad mode on, so it reuses the key's compiled graph. seal() then makes
a missing or unchecked key fatal. `--graphs check` repeats the loss self-check on a deterministic
sample of timed steps (not the gradient check: its eager backward would add to value_embeds'
gradient buffer a second time). Guards are `if ...: raise StepGraphError`, never `assert` (they
must survive -O).

Provenance: record #360 (ANVIL2) `_CGraphRunner` (fwd/bwd, `_acc`, `_sink_flat` ring,
`_selfcheck_now`, `seal`), via shared/reference/step_graphs_seed.py. Deviations from the seed: the
device calls go through a GraphBackend (CPU stand-in for tests); Adam accumulation follows the
plan, not `p.grad is None`; micro-steps (gradient accumulation) are supported; no n-gram ring
(the store accumulates each sink gradient at once, perf/ngram_store.py); seal() also checks that every key produces gradients for the same
parameters; per-key capture/replay statistics (capture_report); no host run-ahead throttle (every
pinned ring is event-guarded); no sampled softmax: the seed's `candidates` key field, its
`cfg.sampled_loss` identity check and its candidate buffers in baked_tensors() are gone, because
no config enabled it, its per-step refill synced the host (torch.unique), and the full softmax is
what loss parity with the record needs (docs/LOG.md, 2026-12-01).

Re-exported here under the seed's names: StepGraphsConfig and the self-check constants
(graphs_config.py), GradHandoff (grad_handoff.py), EagerStep (eager_step.py), StepRunner,
training_loss, live_key, check_key (step_runner.py), StepGraphError (capture_support.py).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from track_1_short.perf.cuda_graphs.capture_plan import StepGraphKey
from track_1_short.perf.cuda_graphs.capture_support import (
    CudaGraphBackend, GraphBackend, StepGraphError, loss_grads, paused_gc, warm_up)
from track_1_short.perf.cuda_graphs.eager_step import EagerStep
from track_1_short.perf.cuda_graphs.grad_handoff import GradHandoff, check_ngram_grad
from track_1_short.perf.cuda_graphs.graphs_config import (
    GRAPH_MODES, SELF_CHECK_ABS, SELF_CHECK_GRAD_REL, SELF_CHECK_REL, StepGraphsConfig)
from track_1_short.perf.cuda_graphs.step_runner import (
    StepRunner, check_key, check_rows_mode, live_key, training_loss)

if TYPE_CHECKING:
    from track_1_short.data import Batch
    from track_1_short.model.gpt import ForwardScheduleConfig
    from track_1_short.ngram_table import NgramTable
    from track_1_short.optim.anvil import AnvilAndAdam
    from track_1_short.perf.ngram_store import NgramStore
    from track_1_short.perf.value_embed_pull import ValueEmbedPull
    from track_1_short.schedule import StepPlan

__all__ = ["GRAPH_MODES", "SELF_CHECK_ABS", "SELF_CHECK_GRAD_REL", "SELF_CHECK_REL", "EagerStep",
           "GradHandoff", "StepGraphError", "StepGraphs", "StepGraphsConfig", "StepRunner",
           "check_key", "live_key", "make_step_runner", "sampled_check_steps", "step_inputs",
           "training_loss"]

# Shapes: T tokens of the key, C cu_seqlens rows, n MTP targets, D n-gram row width.


@dataclass(slots=True)
class StaticInputs:
    """One key's input buffers: the graphs read these addresses, each step copies its batch in."""

    inputs: Tensor  # int32 [T]
    targets: Tensor  # int64 [T]
    cum_seqlens: Tensor  # int32 [C]
    ngram_slots: Tensor  # [2T] indices into the n-gram row cache
    mtp_weights: Tensor  # [n]
    prefix_weight: Tensor  # 0-d
    ngram_ids: Tensor  # int64 [2T] table rows (written by the forward graph with rows in the step)

    def buffers(self) -> tuple[Tensor, ...]:
        """The buffers step_inputs fills, in its order."""
        return (self.inputs, self.targets, self.cum_seqlens, self.ngram_slots, self.mtp_weights,
                self.prefix_weight)

    @classmethod
    def like(cls, batch: Batch, ngram_slots: Tensor | None, cfg: ForwardScheduleConfig) -> "StaticInputs":
        """Fresh buffers shaped as this step's tensors (the slots and ids [2T] int64 whether or
        not the slots were given)."""
        tensors = [None if t is None else t.clone() for t in step_inputs(batch, ngram_slots, cfg)]
        rows = 2 * batch.inputs.numel()
        slots = tensors[3] if tensors[3] is not None else batch.inputs.new_zeros(rows, dtype=torch.int64)
        tensors[3] = slots
        return cls(*tensors, ngram_ids=torch.zeros_like(slots))


def step_inputs(batch: Batch, ngram_slots: Tensor | None, cfg: ForwardScheduleConfig):
    """This step's tensors, in StaticInputs.buffers() order (ngram_slots None: rows in the step)."""
    return (batch.inputs, batch.targets, batch.cum_seqlens, ngram_slots, cfg.mtp_weights,
            cfg.prefix_weight)


def sampled_check_steps(num_steps: int, fraction: float, seed: int) -> frozenset[int]:
    """Timed steps re-self-checked in mode "check": deterministic from the seed, equal on all ranks."""
    rng = random.Random(seed)
    return frozenset(step for step in range(num_steps) if rng.random() < fraction)


@dataclass(slots=True)
class CapturedStep:
    key: StepGraphKey
    static: StaticInputs
    cfg: ForwardScheduleConfig  # the key's config, reading static.mtp_weights / prefix_weight
    ngram_sink: Tensor  # [2T, D] the zeros leaf the forward adds to the n-gram rows
    attn_scales: tuple[float, ...]  # YaRN attention scales the compiled forward baked
    forward: Any  # CUDAGraph (or FakeGraph)
    backward: Any
    loss: Tensor | None = None  # 0-d forward output (pool memory)
    grads: list[tuple[nn.Parameter, Tensor]] = field(default_factory=list)  # backward outputs
    ngram_grad: Tensor | None = None  # [2T, D] backward output: the sink's gradient (pool memory)


@dataclass(slots=True)
class KeyStats:
    key: StepGraphKey
    steps_served: int
    capture_s: float
    pool_mib_added: float | None  # None on the CPU stand-in
    eager_ms: float  # last warm iteration, forward + backward, synchronized
    replay_ms: float | None = None  # forward + backward replay on the self-check visit
    self_checks: int = 0
    max_loss_diff: float = 0.0
    max_grad_rel_err: float | None = None  # worst gradient, warmup self-check (None: not checked)


@dataclass(slots=True)
class _InFlight:
    cs: CapturedStep
    step: int
    micro_step: int
    forward_ms: float | None  # set on the timed (self-check) visit
    check_grads: bool = False  # the key's first self-check: compare the backward too


class StepGraphs:
    """Concern: the training step's forward and backward as CUDA graphs, one pair per key, with
    their capture, replay and self-checks. Created by trainer/build.py (make_step_runner); used by
    train_step for every step, warmup and timed: forward(), backward()."""

    def __init__(self, model: nn.Module, optimizer: AnvilAndAdam, step_keys: list[StepGraphKey],
                 ngram_table: NgramTable, value_embeds: ValueEmbedPull, max_step_tokens: int, *,
                 plans: Sequence[StepPlan], micro_steps: int,
                 config: StepGraphsConfig | None = None, backend: GraphBackend | None = None,
                 device: torch.device | None = None, ngram_store: NgramStore | None = None,
                 embed_grad: Tensor | None = None):
        """ngram_store: the rows inside the step (one rank; NgramStore.rows_in_step): forward() then
        takes ngram_slots None and the graphs pull and hold the rows. embed_grad: the token
        embedding's pulled-gradient buffer (GPT.embed_grad_accum; the backward adds into it and
        the embedding gets no .grad), or None for its dense gradient."""
        if ngram_store is not None and not ngram_store.rows_in_step:
            raise StepGraphError(f"rows inside the step need one rank; the n-gram store is sharded "
                                 f"over {ngram_store.world_size}")
        self.ngram_store = ngram_store
        self.model = model  # the compiled GPT
        self.config = config or StepGraphsConfig()
        self.params = list(optimizer.param_cfgs)
        self.param_names = {p: name for name, p in model.named_parameters()}
        self.handoff = GradHandoff(optimizer.param_cfgs, plans, micro_steps)
        self.step_keys = list(step_keys)  # step -> key, for every training step
        self.ngram_table = ngram_table
        self.value_embeds = value_embeds
        self.embed_grad = embed_grad
        self.max_step_tokens = max_step_tokens
        self.backend = backend or CudaGraphBackend()
        self.stream = self.backend.new_stream(device)
        # One pool for every key's two graphs. Replays never interleave across keys (forward and
        # backward of one key are adjacent), so blocks freed after one capture can serve another's.
        self.pool = self.backend.pool_handle()
        self.captured: dict[StepGraphKey, CapturedStep] = {}
        self.unchecked: set[StepGraphKey] = set()
        self.stats: dict[StepGraphKey, KeyStats] = {}
        self.sealed = False
        self.check_steps = (sampled_check_steps(len(self.step_keys), self.config.check_fraction,
                                                self.config.seed)
                            if self.config.mode == "check" else frozenset())
        self.in_flight: _InFlight | None = None

    def _attn_scales(self) -> tuple[float, ...]:
        return tuple(yarn.attn_scale
                     for yarn in (self.model.yarn, self.model.yarn_paired_head, self.model.yarn_wide))

    def _loss(self, cs: CapturedStep) -> Tensor:
        s = cs.static
        if self.ngram_store is not None:  # rows in the step: the forward graph pulls them
            self.ngram_store.pull_(s.inputs, s.ngram_ids, s.ngram_slots)
        return training_loss(self.model, s.inputs, s.targets, s.cum_seqlens, s.ngram_slots, cs.cfg,
                             cs.ngram_sink, self.value_embeds.grad_accum, self.handoff.loss_scale,
                             embed_grad=self.embed_grad)

    def _leaves(self, cs: CapturedStep) -> list[Tensor]:
        """What the captured backward differentiates: every parameter, then the n-gram sink."""
        return self.params + [cs.ngram_sink]

    def _after_backward(self, cs: CapturedStep):
        """What the backward graph runs after the gradients: with rows in the step, the sink
        gradient (the last leaf's) added into the store's accumulator; else nothing."""
        if self.ngram_store is None:
            return None
        return lambda grads: self.ngram_store.accumulate_(grads[-1], cs.static.ngram_ids)

    def _replay(self, graph: Any, timed: bool) -> float | None:
        if not timed:
            graph.replay()
            return None
        self.backend.synchronize()
        start = time.perf_counter()
        graph.replay()
        self.backend.synchronize()
        return (time.perf_counter() - start) * 1e3

    # ---- per step ----

    def forward(self, step: int, batch: Batch, ngram_slots: Tensor | None, cfg: ForwardScheduleConfig,
                *, micro_step: int = 0) -> Tensor:
        """Copy this step's batch into its key's buffers and replay the forward (capturing it first
        on the key's first warmup visit). Returns the 0-d loss: GRAPH MEMORY, overwritten by the
        next forward replay of this key; .item() or clone() it before then to keep it.
        ngram_slots None exactly when the rows are pulled in the step (ngram_store given)."""
        key = check_key(step, batch, cfg, self.step_keys)
        check_rows_mode(step, ngram_slots, self.ngram_store)
        cs = self.captured.get(key)
        fresh = cs is None
        if fresh:
            # Captures are warmup-only: after seal() a missing graph is fatal, never a silent eager step.
            if self.sealed:
                raise StepGraphError(f"step {step}: no step graph for key {key} after seal()")
            cs = self._capture(key, batch, ngram_slots, cfg)
        self._check_frozen_values(step, cs, cfg)
        for dst, src in zip(cs.static.buffers(), step_inputs(batch, ngram_slots, cfg)):
            if src is not None:  # None: the slots, which the forward graph writes itself
                dst.copy_(src)
        # Not on the capture visit: the buffers would still hold the batch the capture recorded with.
        first_check = not fresh and key in self.unchecked
        forward_ms = self._replay(cs.forward, timed=first_check)
        sampled = self.sealed and micro_step == 0 and step in self.check_steps
        if first_check or sampled:
            self._self_check(cs, step)
        self.in_flight = _InFlight(cs, step, micro_step, forward_ms, check_grads=first_check)
        return cs.loss

    def _check_frozen_values(self, step: int, cs: CapturedStep, cfg: ForwardScheduleConfig) -> None:
        # The attention scales are Python floats the compiled forward baked; they follow the window
        # schedule (YaRN is applied at a key's first step), so they must still be the captured ones.
        scales = self._attn_scales()
        if scales != cs.attn_scales:
            raise StepGraphError(f"step {step}, key {cs.key}: YaRN attention scales (yarn, "
                                 f"yarn_paired_head, yarn_wide) {scales} != captured {cs.attn_scales}")

    def backward(self) -> Tensor | None:
        """Replay the backward and set p.grad (GradHandoff). Returns the n-gram sink gradient
        [2T, D]: GRAPH MEMORY, overwritten by the next backward replay of this key (the caller's
        NgramStore.hold reads it at once); None with rows in the step (the graph added it into
        the store's accumulator)."""
        flight = self.in_flight
        if flight is None:
            raise StepGraphError("backward() without a preceding forward()")
        self.in_flight = None
        # the key's first check: the pulled buffers as they were, to isolate what the replay adds
        before = [b.clone() for _, b in self._pulled()] if flight.check_grads else None
        backward_ms = self._replay(flight.cs.backward, timed=flight.forward_ms is not None)
        if backward_ms is not None:
            self.stats[flight.cs.key].replay_ms = flight.forward_ms + backward_ms
        if flight.check_grads:
            # Warmup only: the eager backward adds into the pulled buffers too; _check_grads
            # compares that with the replay's addition and puts the buffers back after the replay.
            self._check_grads(flight.cs, flight.step, before)
            self.unchecked.discard(flight.cs.key)
        self.handoff.hand_over(flight.step, flight.micro_step, flight.cs.grads)
        return None if self.ngram_store is not None else flight.cs.ngram_grad

    # ---- capture and checks (warmup only) ----

    def _capture(self, key: StepGraphKey, batch: Batch, ngram_slots: Tensor,
                 cfg: ForwardScheduleConfig) -> CapturedStep:
        if key.tokens > self.max_step_tokens:
            raise StepGraphError(f"key {key}: {key.tokens} tokens > max_step_tokens "
                                 f"{self.max_step_tokens} (the n-gram sink is sized from it)")
        static = StaticInputs.like(batch, ngram_slots, cfg)
        cs = CapturedStep(
            key=key, static=static,
            cfg=dataclasses.replace(cfg, mtp_weights=static.mtp_weights,
                                    prefix_weight=static.prefix_weight),
            ngram_sink=self.ngram_table.grad_sink(key.tokens),
            attn_scales=self._attn_scales(),
            forward=self.backend.new_graph(), backward=self.backend.new_graph())
        leaves = self._leaves(cs)
        start = time.perf_counter()
        # The warm iterations add into value_embeds' gradient buffer: harmless, the post-warmup
        # reset clears it.
        eager_ms = warm_up(self.backend, self.stream, lambda: loss_grads(self._loss(cs), leaves),
                           self.config.warm_iterations, self.config.sync_debug_warmup)
        with paused_gc():
            pair = self.backend.capture_pair(cs.forward, cs.backward, lambda: self._loss(cs), leaves,
                                             pool=self.pool, stream=self.stream, key=key,
                                             after_backward=self._after_backward(cs))
        cs.loss = pair.loss
        # value_embeds' table (and the pulled embedding's) gets None: its gradient went to its buffer.
        cs.grads = [(p, g) for p, g in zip(self.params, pair.grads) if g is not None]
        cs.ngram_grad = pair.grads[-1]
        check_ngram_grad(key, cs.ngram_grad)
        self.captured[key] = cs
        self.unchecked.add(key)
        self.stats[key] = KeyStats(
            key=key, steps_served=self.step_keys.count(key),
            capture_s=time.perf_counter() - start, eager_ms=eager_ms,
            pool_mib_added=None if pair.pool_bytes_added is None else pair.pool_bytes_added / 2**20)
        return cs

    def _self_check(self, cs: CapturedStep, step: int) -> None:
        """Replay vs eager forward on the same buffers: catches a graph that baked an input's value or
        a stale address instead of reading the live tensor.

        The eager forward runs with grad mode on, like the captured one, and its autograd graph is
        dropped unused: under no_grad dynamo's grad-mode guard would fail and compile an inference
        graph per key (a second compile of every key, ~30-60 s each for the full model), and the
        check would then compare different generated kernels."""
        replay = cs.loss.item()
        eager = self._loss(cs).detach().item()
        diff = abs(replay - eager)
        tolerance = max(self.config.self_check_abs, abs(eager) * self.config.self_check_rel)
        stats = self.stats[cs.key]
        stats.self_checks += 1
        stats.max_loss_diff = max(stats.max_loss_diff, diff)
        if not diff <= tolerance:  # written so that NaN fails too
            raise StepGraphError(f"step {step}: step graph {cs.key} replay loss {replay} != eager "
                                 f"loss {eager} on the same buffers (|diff| {diff:.3g} > "
                                 f"{tolerance:.3g}): the graph baked a value or a stale address")

    def _pulled(self) -> list[tuple[str, Tensor]]:
        """The persistent buffers the backward adds gradients into, by name: value_embeds'
        grad_accum and the token embedding's pulled gradient (when given)."""
        pulled = [("value_embeds.grad_accum", self.value_embeds.grad_accum)]
        if self.embed_grad is not None:
            pulled.append(("embed_grad_accum", self.embed_grad))
        return pulled

    def _check_grads(self, cs: CapturedStep, step: int, before: list[Tensor]) -> None:
        """Every gradient the backward replay wrote vs an eager backward on the same buffers, the
        pulled buffers' additions too (`before`: their values before the replay; after the check
        they hold the replay's addition only, as without a check)."""
        leaves = self._leaves(cs)
        pulled = self._pulled()
        after_replay = [b.clone() for _, b in pulled]
        eager = dict(zip(leaves, loss_grads(self._loss(cs), leaves)))
        replayed = [*cs.grads, (cs.ngram_sink, cs.ngram_grad)]
        if any(eager[p] is None for p, _ in replayed):
            raise StepGraphError(f"step {step}: step graph {cs.key}: the eager backward has no "
                                 f"gradient for a parameter the captured backward wrote")
        # (name, replayed, eager) for every gradient, the pulled ones as additions to their buffer
        pairs = [("ngram_sink" if p is cs.ngram_sink else self.param_names.get(p, "?"), g, eager[p])
                 for p, g in replayed]
        for (name, buffer), b0, b1 in zip(pulled, before, after_replay):
            pairs.append((name, b1 - b0, buffer - b1))
            buffer.copy_(b1)
        norms = torch.stack([e.float().norm() for _, _, e in pairs])
        floor = max(1e-6 * float(norms.norm()), 1e-12)
        errors = torch.stack([(g.float() - e.float()).norm() for _, g, e in pairs]) / norms.clamp_min(floor)
        errors = errors.tolist()  # one host sync for all parameters
        worst = max(range(len(errors)), key=errors.__getitem__)
        stats = self.stats[cs.key]
        stats.max_grad_rel_err = max(stats.max_grad_rel_err or 0.0, errors[worst])
        if not errors[worst] <= self.config.self_check_grad_rel:  # NaN fails too
            name = pairs[worst][0]
            raise StepGraphError(f"step {step}: step graph {cs.key} replayed gradient of {name} "
                                 f"differs from eager on the same buffers (relative error "
                                 f"{errors[worst]:.3g} > {self.config.self_check_grad_rel:.3g}): an "
                                 f"op in the backward is not capture-safe or baked a value")

    def seal(self) -> None:
        """After warmup: every key the timed run reaches owns a self-checked capture, and every key
        produces gradients for the same parameters (else one p.grad would go stale)."""
        missing = [key for key in dict.fromkeys(self.step_keys) if key not in self.captured]
        if missing:
            firsts = [self.step_keys.index(key) for key in missing]
            raise StepGraphError(f"seal: step graphs never captured for keys {missing} (first "
                                 f"steps {firsts}); the warmup plan must visit each key twice")
        if self.unchecked:
            raise StepGraphError(f"seal: step graphs never self-checked: {sorted(self.unchecked)}; "
                                 f"each key needs a second warmup visit")
        reference = None
        for key, cs in self.captured.items():
            names = sorted(self.param_names.get(p, "?") for p, _ in cs.grads)
            if reference is not None and names != reference[1]:
                raise StepGraphError(f"seal: key {key} has gradients for {names}, key "
                                     f"{reference[0]} for {reference[1]}")
            reference = reference or (key, names)
        self.sealed = True

    def baked_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(role, tensor) for every tensor the step graphs bake or hand to the optimizer that the
        model's parameters and buffers do not cover, read live from their owners (a rebind shows)."""
        yield from self._pulled()
        for tokens, sink in self.ngram_table.sinks.items():
            yield f"ngram_table.sinks[{tokens}]", sink
        for p, acc in self.handoff.accumulators.items():
            yield f"grad_accumulator[{self.param_names.get(p, '?')}]", acc
        if self.ngram_store is not None:
            yield from self.ngram_store.baked_tensors()
        for cs in self.captured.values():
            tag = "step_graph" + str(tuple(cs.key))
            for f in dataclasses.fields(cs.static):
                yield f"{tag}.{f.name}", getattr(cs.static, f.name)

    def capture_report(self) -> list[dict]:
        """Per key: steps served, capture seconds, pool MiB added, eager vs replay ms, self-checks."""
        rows = []
        for stats in self.stats.values():
            row = dataclasses.asdict(stats)
            row["key"] = stats.key._asdict()
            row["speedup"] = (stats.eager_ms / stats.replay_ms) if stats.replay_ms else None
            rows.append(row)
        return rows


def make_step_runner(config: StepGraphsConfig, *, model: nn.Module, optimizer: AnvilAndAdam,
                     step_keys: list[StepGraphKey], ngram_table: NgramTable,
                     value_embeds: ValueEmbedPull, max_step_tokens: int, plans: Sequence[StepPlan],
                     micro_steps: int, device: torch.device | None = None,
                     backend: GraphBackend | None = None,
                     ngram_store: NgramStore | None = None,
                     embed_grad: Tensor | None = None) -> StepRunner:
    """`--graphs off` -> EagerStep; `on` / `check` -> StepGraphs. `plans`: the schedule's plan of
    every step (GradHandoff's copy vs add); `micro_steps`: backwards per step (RunSpec.micro_steps);
    `ngram_store`: the n-gram rows pulled and held inside the step (one rank), else None;
    `embed_grad`: the token embedding's pulled-gradient buffer, else None (dense .grad)."""
    if config.mode == "off":
        return EagerStep(model, optimizer, step_keys, ngram_table, value_embeds, plans=plans,
                         micro_steps=micro_steps, ngram_store=ngram_store, embed_grad=embed_grad)
    return StepGraphs(model, optimizer, step_keys, ngram_table, value_embeds, max_step_tokens,
                      plans=plans, micro_steps=micro_steps, config=config, backend=backend, device=device,
                      ngram_store=ngram_store, embed_grad=embed_grad)
