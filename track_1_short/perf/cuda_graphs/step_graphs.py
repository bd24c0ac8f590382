"""CUDA graphs of the training step's forward and backward: one captured pair per StepGraphKey.

What it replaces: running the compiled model eagerly every step, which launches ~650 kernels + 69
memsets in the forward call and ~73 in backward() per stage-A micro-step from Python, at ~21 ms
of host time against ~28 ms of GPU time (facts section 8, one H200, torch 2.11): near host-bound
at stage A with 8 ranks. Why it is faster: a replay launches the whole forward (or backward) as
one graph, so the host cost per step drops to a handful of copies and two replays, and the host
runs ahead of the device. Record #360 measured ~3.0 s over the run for this and its other graphs.

What is captured, per key (capture_plan.StepGraphKey: shapes and Python values the compiled model
specializes on):
    forward   training_loss(): the model's per-token loss, summed
    backward  capture_support.loss_grads(): gradients w.r.t. every parameter and the n-gram sink
Between the two replays the host runs the eager row-pull id exchange (perf/row_prefetch.py), so the
all_to_all hides under the backward exactly as it does without graphs.

What must stay address-stable (a replay reads and writes the addresses the capture saw):
- the per-key StaticInputs owned here: inputs, targets, cum_seqlens, n-gram cache slots, MTP and
  prefix weights; each step copies its batch into them before the forward replay
- every parameter's .data and every model buffer (fp8 scales, YaRN tables, n-gram row
  cache, prefix table), the n-gram sink leaves (NgramTable.grad_sink / .sinks), value_embeds'
  gradient buffer (ValueEmbedPull.grad_accum), the sampled-softmax candidate buffers, and the
  persistent gradient accumulators and n-gram ring owned here.
baked_addresses.py censuses all of them (baked_tensors() reads them live from their owners) before
and after the post-warmup reset. Python values the capture froze: the key (checked against the
schedule at every forward), the three YaRN attention scales and the sampled-loss object (re-checked
at every replay).

Gradients (GradHandoff; identical in the eager twin): the captured backward writes each gradient
into its own pool buffer, rewritten by the next replay of that key; no AccumulateGrad runs. ANVIL
banks take the graph's buffer as p.grad (their reduce-scatter reads it before the next backward);
Adam parameters, stepped every `adam_every` steps on the summed gradient, go through one persistent
accumulator per parameter: copy on the first step of the cycle, add on the others, decided from
the cadence (not from `p.grad is None`, which breaks when the optimizer keeps .grad). With
grad_accum_steps > 1 (fewer than 8 GPUs) ANVIL banks get persistent accumulators as well. The
n-gram sink gradient is held by the table until its update event, up to MAX_CYCLE_STEPS steps, so a
non-event step's copy goes to a private ring slot (hold_ngram_grad).

Call order per micro-step (train_step, warmup and timed alike; EagerStep has the same interface):
    loss = runner.forward(step, batch, ngram_slots, cfg, micro_step=m)   # graph memory
    <row_prefetch id exchange for the next step>
    ngram_grad = runner.backward()                                         # sets p.grad
    held = runner.hold_ngram_grad(ngram_grad, pending, event_this_step)
    optimizer phases (read p.grad before the next backward)
After warmup: post-warmup reset, census compared, runner.seal().

Capture protocol: the first warmup visit of a key runs WARM_ITERATIONS eager iterations on the side
stream and captures both graphs (capture_support), then replays the forward; the second visit
replays both and compares the loss with an eager forward and every gradient with an eager backward
on the same buffers (an op that is not capture-safe can replay a right loss and wrong gradients).
The eager forward runs with grad mode on, so it reuses the key's compiled graph. seal() then makes
a missing or unchecked key fatal. `--graphs check` repeats the loss self-check on a deterministic
sample of timed steps (not the gradient check: its eager backward would add to value_embeds'
gradient buffer a second time). Guards are `if ...: raise StepGraphError`, never `assert` (they must survive -O).

Provenance: record #360 (ANVIL2) `_CGraphRunner` (fwd/bwd, `_acc`, `_sink_flat` ring,
`_selfcheck_now`, `seal`), via shared/reference/step_graphs_seed.py. Deviations from the seed: the
device calls go through a GraphBackend (CPU stand-in for tests); Adam accumulation follows the
cadence, not `p.grad is None`; micro-steps (gradient accumulation) are supported; the n-gram ring
is sized from the sink gradient's width (the table's row width) and allocated at the first
capture in its dtype; seal()
also checks that every key produces gradients for the same parameters; per-key capture/replay
statistics (capture_report); no host run-ahead throttle (every pinned ring is event-guarded).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from track_1_short.data import Batch
from track_1_short.perf.cuda_graphs.capture_plan import StepGraphKey
from track_1_short.perf.cuda_graphs.capture_support import (
    WARM_ITERATIONS, CudaGraphBackend, GraphBackend, StepGraphError, loss_grads, paused_gc, warm_up)
from track_1_short.schedule import MAX_CYCLE_STEPS

if TYPE_CHECKING:
    from track_1_short.model.gpt import ForwardScheduleConfig
    from track_1_short.ngram_table import NgramTable
    from track_1_short.optim.anvil import AnvilAndAdam
    from track_1_short.perf.value_embed_pull import ValueEmbedPull

# Shapes: T tokens of the key, C cu_seqlens rows, n MTP targets, D n-gram row width.

# The self-check compares scalar losses of two runs of the same kernels; atomics in the loss kernels
# make them not bitwise equal (record #360's tolerance).
SELF_CHECK_ABS, SELF_CHECK_REL = 1e-3, 5e-4
# The warmup self-check also compares every gradient the backward graph wrote with an eager backward
# on the same buffers: ||replay - eager|| <= SELF_CHECK_GRAD_REL * max(||eager||, floor), floor =
# 1e-6 * the norm of all gradients (gradients that are zero up to rounding at init: facts of the
# GPU tests). A graph can replay the right loss and wrong gradients (an op that is not capture-safe
# in the backward), so the loss check alone is not enough.
SELF_CHECK_GRAD_REL = 1e-2
GRAPH_MODES = ("on", "off", "check")


@dataclass(slots=True, kw_only=True)
class StepGraphsConfig:
    """`--graphs {on,off,check}` and the self-check knobs."""

    mode: str = "on"  # on: graphs; off: EagerStep; check: graphs + sampled self-checks when timed
    check_fraction: float = 0.01  # share of timed steps self-checked in mode "check"
    seed: int = 0  # seeds the choice of checked steps (same on every rank)
    self_check_abs: float = SELF_CHECK_ABS
    self_check_rel: float = SELF_CHECK_REL
    self_check_grad_rel: float = SELF_CHECK_GRAD_REL
    warm_iterations: int = WARM_ITERATIONS
    sync_debug_warmup: bool = False  # warm iterations after the first under sync debug "error"

    def __post_init__(self):
        if self.mode not in GRAPH_MODES:
            raise ValueError(f"mode={self.mode!r}: --graphs must be one of {GRAPH_MODES}")
        if not 0.0 <= self.check_fraction <= 1.0:
            raise ValueError(f"check_fraction={self.check_fraction} must be in [0, 1]")
        if min(self.self_check_abs, self.self_check_rel, self.self_check_grad_rel) < 0:
            raise ValueError("self_check_abs, self_check_rel and self_check_grad_rel must be >= 0")
        if self.warm_iterations < 1:
            raise ValueError(f"warm_iterations={self.warm_iterations} must be >= 1 (the first "
                             f"compiles; capturing a compile is not possible)")


@dataclass(slots=True)
class StaticInputs:
    """One key's input buffers: the graphs read these addresses, each step copies its batch in."""

    inputs: Tensor  # int32 [T]
    targets: Tensor  # int64 [T]
    cum_seqlens: Tensor  # int32 [C]
    ngram_slots: Tensor  # [2T] indices into the n-gram row cache
    mtp_weights: Tensor  # [n]
    prefix_weight: Tensor  # 0-d

    def buffers(self) -> tuple[Tensor, ...]:
        return (self.inputs, self.targets, self.cum_seqlens, self.ngram_slots, self.mtp_weights,
                self.prefix_weight)


def step_inputs(batch: Batch, ngram_slots: Tensor, cfg: ForwardScheduleConfig):
    """This step's tensors, in StaticInputs order."""
    return (batch.inputs, batch.targets, batch.cum_seqlens, ngram_slots, cfg.mtp_weights,
            cfg.prefix_weight)


def live_key(batch: Batch, cfg: ForwardScheduleConfig) -> StepGraphKey:
    return StepGraphKey(
        tokens=batch.inputs.numel(),
        cu_seqlens_rows=batch.cum_seqlens.numel(),
        mtp_targets=cfg.mtp_weights.numel(),
        candidates=0 if cfg.sampled_loss is None else cfg.sampled_loss.rows.shape[0],
        ws_short=cfg.ws_short,
        ws_long=cfg.ws_long,
        max_seq_len=cfg.train_max_seq_len,
    )


def check_key(step: int, batch: Batch, cfg: ForwardScheduleConfig,
              step_keys: list[StepGraphKey]) -> StepGraphKey:
    """The live key, which must be the schedule's key of `step`: a replay cannot re-run dynamo's
    guards, and a new shape would mean a new graph (or, eagerly, a recompile)."""
    if not 0 <= step < len(step_keys):
        raise StepGraphError(f"step {step}: outside the planned training steps [0, {len(step_keys)})")
    key = live_key(batch, cfg)
    if key != step_keys[step]:
        raise StepGraphError(f"step {step}: live key {key} != schedule key {step_keys[step]}; the "
                             f"batch or forward config does not match the schedule")
    return key


def training_loss(model: nn.Module, inputs: Tensor, targets: Tensor, cum_seqlens: Tensor,
                  ngram_slots: Tensor, cfg: ForwardScheduleConfig, ngram_sink: Tensor,
                  value_embed_grad: Tensor, grad_scale: float = 1.0) -> Tensor:
    """THE step loss (0-d): the single definition run by the capture, the warm iterations, the
    self-check and the eager twin. grad_scale = 1 / grad_accum_steps (a constant of the run): with
    the optimizer's AVG over ranks, every world size then sees the mean over the step's slices."""
    return model(inputs, targets, cum_seqlens, ngram_slots, cfg, ngram_sink=ngram_sink,
                 value_embed_grad=value_embed_grad).sum() * grad_scale


class GradHandoff:
    """Sets p.grad after a backward as loss.backward() plus the optimizer's cadence would.

    ANVIL (grad_accum_steps == 1): p.grad = the backward's own buffer (graph memory under graphs,
    overwritten by the next replay of that key: the optimizer consumes it in this step).
    Otherwise p.grad = a persistent accumulator owned here (address-stable, censused): copied on
    the first backward of its accumulation cycle, added on the others.
    """

    __slots__ = ("anvil_params", "adam_every", "grad_accum_steps", "accumulators")

    def __init__(self, param_cfgs: dict[nn.Parameter, Any], adam_every: int, grad_accum_steps: int):
        if adam_every < 1 or grad_accum_steps < 1:
            raise ValueError(f"adam_every={adam_every} and grad_accum_steps={grad_accum_steps} "
                             f"must be >= 1")
        self.anvil_params = {p for p, cfg in param_cfgs.items() if cfg.optim == "anvil"}
        self.adam_every = adam_every
        self.grad_accum_steps = grad_accum_steps
        self.accumulators: dict[nn.Parameter, Tensor] = {}

    @property
    def loss_scale(self) -> float:
        """training_loss's grad_scale: each micro-step contributes 1 / grad_accum_steps."""
        return 1.0 / self.grad_accum_steps

    def hand_over(self, step: int, micro_step: int,
                  grads: Iterable[tuple[nn.Parameter, Tensor]]) -> None:
        if not 0 <= micro_step < self.grad_accum_steps:
            raise StepGraphError(f"step {step}: micro_step {micro_step} outside "
                                 f"[0, grad_accum_steps={self.grad_accum_steps})")
        adam_first = micro_step == 0 and step % self.adam_every == 0
        copies, adds = [], []
        for p, grad in grads:
            anvil = p in self.anvil_params
            if anvil and self.grad_accum_steps == 1:
                p.grad = grad
                continue
            acc = self.accumulators.get(p)
            if acc is None:
                acc = self.accumulators[p] = torch.empty_like(grad)
            first = micro_step == 0 if anvil else adam_first
            (copies if first else adds).append((acc, grad))
            p.grad = acc
        if copies:
            torch._foreach_copy_([acc for acc, _ in copies], [g for _, g in copies])
        if adds:
            torch._foreach_add_([acc for acc, _ in adds], [g for _, g in adds])


def check_ngram_pending(pending: int, ring_slots: int) -> None:
    if not 0 <= pending < ring_slots:
        raise StepGraphError(f"{pending} n-gram gradients already held, ring has {ring_slots} "
                             f"slots (cycle x micro-steps): an n-gram update event was missed or the cadence "
                             f"exceeds MAX_CYCLE_STEPS")


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
    """The training step's forward and backward graphs. Created in main() (make_step_runner); used
    by train_step for every step, warmup and timed: forward(), backward(), hold_ngram_grad()."""

    def __init__(self, model: nn.Module, optimizer: AnvilAndAdam, step_keys: list[StepGraphKey],
                 ngram_table: NgramTable, value_embeds: ValueEmbedPull, max_step_tokens: int, *,
                 adam_every: int, grad_accum_steps: int = 1, config: StepGraphsConfig | None = None,
                 backend: GraphBackend | None = None, device: torch.device | None = None,
                 ngram_ring_slots: int = MAX_CYCLE_STEPS):
        self.model = model  # the compiled GPT
        self.config = config or StepGraphsConfig()
        self.params = list(optimizer.param_cfgs)
        self.param_names = {p: name for name, p in model.named_parameters()}
        self.handoff = GradHandoff(optimizer.param_cfgs, adam_every, grad_accum_steps)
        self.step_keys = list(step_keys)  # step -> key, for every training step
        self.ngram_table = ngram_table
        self.value_embeds = value_embeds
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
        # n-gram sink gradients held until the update event: slot i holds pending entry i of the
        # cycle. Flat [2 * max_step_tokens * D]; each key views its own [2T, D] prefix. Allocated
        # at the first capture, in the sink gradient's dtype and device.
        self.ngram_ring_slots = ngram_ring_slots
        self.ngram_grad_ring: list[Tensor] = []
        self.check_steps = (sampled_check_steps(len(self.step_keys), self.config.check_fraction,
                                                self.config.seed)
                            if self.config.mode == "check" else frozenset())
        self.in_flight: _InFlight | None = None

    def _attn_scales(self) -> tuple[float, ...]:
        return tuple(yarn.attn_scale
                     for yarn in (self.model.yarn, self.model.yarn_paired_head, self.model.yarn_wide))

    def _loss(self, cs: CapturedStep) -> Tensor:
        s = cs.static
        return training_loss(self.model, s.inputs, s.targets, s.cum_seqlens, s.ngram_slots, cs.cfg,
                             cs.ngram_sink, self.value_embeds.grad_accum, self.handoff.loss_scale)

    def _leaves(self, cs: CapturedStep) -> list[Tensor]:
        """What the captured backward differentiates: every parameter, then the n-gram sink."""
        return self.params + [cs.ngram_sink]

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

    def forward(self, step: int, batch: Batch, ngram_slots: Tensor, cfg: ForwardScheduleConfig, *,
                micro_step: int = 0) -> Tensor:
        """Copy this step's batch into its key's buffers and replay the forward (capturing it first
        on the key's first warmup visit). Returns the 0-d loss: GRAPH MEMORY, overwritten by the
        next forward replay of this key; .item() or clone() it before then to keep it."""
        key = check_key(step, batch, cfg, self.step_keys)
        cs = self.captured.get(key)
        fresh = cs is None
        if fresh:
            # Captures are warmup-only: after seal() a missing graph is fatal, never a silent eager step.
            if self.sealed:
                raise StepGraphError(f"step {step}: no step graph for key {key} after seal()")
            cs = self._capture(key, batch, ngram_slots, cfg)
        self._check_frozen_values(step, cs, cfg)
        for dst, src in zip(cs.static.buffers(), step_inputs(batch, ngram_slots, cfg)):
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
        # Candidate buffers of one P are allocated once, so the same object means the same addresses.
        if cfg.sampled_loss is not cs.cfg.sampled_loss:
            raise StepGraphError(f"step {step}, key {cs.key}: sampled_loss object "
                                 f"{id(cfg.sampled_loss):#x} is not the captured one "
                                 f"{id(cs.cfg.sampled_loss):#x}; refill its buffers in place")

    def backward(self) -> Tensor:
        """Replay the backward and set p.grad (GradHandoff). Returns the n-gram sink gradient
        [2T, D]: GRAPH MEMORY, overwritten by the next backward replay of this key; keep it past
        this step only through hold_ngram_grad()."""
        flight = self.in_flight
        if flight is None:
            raise StepGraphError("backward() without a preceding forward()")
        self.in_flight = None
        backward_ms = self._replay(flight.cs.backward, timed=flight.forward_ms is not None)
        if backward_ms is not None:
            self.stats[flight.cs.key].replay_ms = flight.forward_ms + backward_ms
        if flight.check_grads:
            # Warmup only: the eager backward also adds into value_embeds' grad_accum once more,
            # which the post-warmup reset clears (a timed step must not have that side effect).
            self._check_grads(flight.cs, flight.step)
            self.unchecked.discard(flight.cs.key)
        self.handoff.hand_over(flight.step, flight.micro_step, flight.cs.grads)
        return flight.cs.ngram_grad

    def hold_ngram_grad(self, ngram_grad: Tensor, pending: int, event_this_step: bool) -> Tensor:
        """The n-gram gradient the table may keep: the graph's own buffer only if this step's update
        event consumes it before the next replay, else a copy in ring slot `pending` (owned here,
        rewritten when slot `pending` is used again in a later cycle)."""
        if event_this_step:
            return ngram_grad
        check_ngram_pending(pending, len(self.ngram_grad_ring))
        slot = self.ngram_grad_ring[pending][:ngram_grad.numel()].view_as(ngram_grad)
        slot.copy_(ngram_grad)
        return slot

    # ---- capture and checks (warmup only) ----

    def _capture(self, key: StepGraphKey, batch: Batch, ngram_slots: Tensor,
                 cfg: ForwardScheduleConfig) -> CapturedStep:
        if key.tokens > self.max_step_tokens:
            raise StepGraphError(f"key {key}: {key.tokens} tokens > max_step_tokens "
                                 f"{self.max_step_tokens} (the n-gram ring is sized from it)")
        static = StaticInputs(*(t.clone() for t in step_inputs(batch, ngram_slots, cfg)))
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
                                             pool=self.pool, stream=self.stream, key=key)
        cs.loss = pair.loss
        # value_embeds' table gets None: its gradient goes to ValueEmbedPull.grad_accum instead.
        cs.grads = [(p, g) for p, g in zip(self.params, pair.grads) if g is not None]
        cs.ngram_grad = pair.grads[-1]
        self._adopt_ngram_grad(key, cs.ngram_grad)
        self.captured[key] = cs
        self.unchecked.add(key)
        self.stats[key] = KeyStats(
            key=key, steps_served=self.step_keys.count(key),
            capture_s=time.perf_counter() - start, eager_ms=eager_ms,
            pool_mib_added=None if pair.pool_bytes_added is None else pair.pool_bytes_added / 2**20)
        return cs

    def _adopt_ngram_grad(self, key: StepGraphKey, ngram_grad: Tensor | None) -> None:
        """Check the sink gradient [2T, D] and size the ring from it (D is the table's row width,
        read from the sink the table allocated, so tiny configs work)."""
        if ngram_grad is None or ngram_grad.dim() != 2 or ngram_grad.shape[0] != 2 * key.tokens:
            shape = None if ngram_grad is None else tuple(ngram_grad.shape)
            raise StepGraphError(f"key {key}: n-gram sink gradient has shape {shape}, expected "
                                 f"[{2 * key.tokens}, D]; the forward must add grad_sink(T)")
        dim = ngram_grad.shape[1]
        if self.ngram_grad_ring and self.ngram_grad_ring[0].dtype != ngram_grad.dtype:
            raise StepGraphError(f"key {key}: n-gram sink gradient dtype {ngram_grad.dtype} != "
                                 f"ring dtype {self.ngram_grad_ring[0].dtype}")
        if not self.ngram_grad_ring:
            self.ngram_grad_ring = [
                torch.empty(2 * self.max_step_tokens * dim, dtype=ngram_grad.dtype,
                            device=ngram_grad.device)
                for _ in range(self.ngram_ring_slots)]

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

    def _check_grads(self, cs: CapturedStep, step: int) -> None:
        """Every gradient the backward replay wrote vs an eager backward on the same buffers."""
        leaves = self._leaves(cs)
        eager = dict(zip(leaves, loss_grads(self._loss(cs), leaves)))
        replayed = [*cs.grads, (cs.ngram_sink, cs.ngram_grad)]
        if any(eager[p] is None for p, _ in replayed):
            raise StepGraphError(f"step {step}: step graph {cs.key}: the eager backward has no "
                                 f"gradient for a parameter the captured backward wrote")
        norms = torch.stack([eager[p].float().norm() for p, _ in replayed])
        floor = max(1e-6 * float(norms.norm()), 1e-12)
        errors = torch.stack([(g.float() - eager[p].float()).norm() for p, g in replayed]) / norms.clamp_min(floor)
        errors = errors.tolist()  # one host sync for all parameters
        worst = max(range(len(errors)), key=errors.__getitem__)
        stats = self.stats[cs.key]
        stats.max_grad_rel_err = max(stats.max_grad_rel_err or 0.0, errors[worst])
        if not errors[worst] <= self.config.self_check_grad_rel:  # NaN fails too
            p = replayed[worst][0]
            name = "ngram_sink" if p is cs.ngram_sink else self.param_names.get(p, "?")
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
        yield "value_embeds.grad_accum", self.value_embeds.grad_accum
        for tokens, sink in self.ngram_table.sinks.items():
            yield f"ngram_table.sinks[{tokens}]", sink
        for i, slot in enumerate(self.ngram_grad_ring):
            yield f"ngram_grad_ring[{i}]", slot
        for p, acc in self.handoff.accumulators.items():
            yield f"grad_accumulator[{self.param_names.get(p, '?')}]", acc
        for cs in self.captured.values():
            tag = "step_graph" + str(tuple(cs.key))
            for f in dataclasses.fields(cs.static):
                yield f"{tag}.{f.name}", getattr(cs.static, f.name)
            if cs.cfg.sampled_loss is not None:
                for f in dataclasses.fields(cs.cfg.sampled_loss):
                    value = getattr(cs.cfg.sampled_loss, f.name)
                    if isinstance(value, Tensor):
                        yield f"{tag}.sampled_loss.{f.name}", value

    def capture_report(self) -> list[dict]:
        """Per key: steps served, capture seconds, pool MiB added, eager vs replay ms, self-checks."""
        rows = []
        for stats in self.stats.values():
            row = dataclasses.asdict(stats)
            row["key"] = stats.key._asdict()
            row["speedup"] = (stats.eager_ms / stats.replay_ms) if stats.replay_ms else None
            rows.append(row)
        return rows


class EagerStep:
    """The eager twin of StepGraphs (`--graphs off`): same methods, same p.grad semantics, runs the
    compiled model directly, so train_step is one piece of code for graphs on and off."""

    def __init__(self, model: nn.Module, optimizer: AnvilAndAdam, step_keys: list[StepGraphKey],
                 ngram_table: NgramTable, value_embeds: ValueEmbedPull, *, adam_every: int,
                 grad_accum_steps: int = 1, ngram_ring_slots: int = MAX_CYCLE_STEPS):
        self.model = model
        self.params = list(optimizer.param_cfgs)
        self.handoff = GradHandoff(optimizer.param_cfgs, adam_every, grad_accum_steps)
        self.step_keys = list(step_keys)
        self.ngram_table = ngram_table
        self.value_embeds = value_embeds
        self.ngram_ring_slots = ngram_ring_slots
        self.in_flight: tuple[int, int, Tensor, Tensor] | None = None

    def forward(self, step: int, batch: Batch, ngram_slots: Tensor, cfg: ForwardScheduleConfig, *,
                micro_step: int = 0) -> Tensor:
        """Run the loss with autograd. Returns the 0-d loss, detached (the caller owns it)."""
        check_key(step, batch, cfg, self.step_keys)
        sink = self.ngram_table.grad_sink(batch.inputs.numel())
        loss = training_loss(self.model, batch.inputs, batch.targets, batch.cum_seqlens,
                             ngram_slots, cfg, sink, self.value_embeds.grad_accum,
                             self.handoff.loss_scale)
        self.in_flight = (step, micro_step, loss, sink)
        return loss.detach()

    def backward(self) -> Tensor:
        """Gradients as the captured backward computes them; sets p.grad (GradHandoff). Returns
        the n-gram sink gradient [2T, D], a fresh tensor the caller owns."""
        if self.in_flight is None:
            raise StepGraphError("backward() without a preceding forward()")
        step, micro_step, loss, sink = self.in_flight
        self.in_flight = None
        grads = loss_grads(loss, self.params + [sink])
        self.handoff.hand_over(step, micro_step,
                               [(p, g) for p, g in zip(self.params, grads) if g is not None])
        return grads[-1]

    def hold_ngram_grad(self, ngram_grad: Tensor, pending: int, event_this_step: bool) -> Tensor:
        """No copy needed (backward() returned a fresh tensor); the ring bound is still enforced."""
        if not event_this_step:
            check_ngram_pending(pending, self.ngram_ring_slots)
        return ngram_grad

    def seal(self) -> None:
        pass

    def baked_tensors(self) -> Iterator[tuple[str, Tensor]]:
        return iter(())

    def capture_report(self) -> list[dict]:
        return []


def make_step_runner(config: StepGraphsConfig, *, model: nn.Module, optimizer: AnvilAndAdam,
                     step_keys: list[StepGraphKey], ngram_table: NgramTable,
                     value_embeds: ValueEmbedPull, max_step_tokens: int, adam_every: int,
                     grad_accum_steps: int = 1, device: torch.device | None = None,
                     backend: GraphBackend | None = None,
                     ngram_ring_slots: int = MAX_CYCLE_STEPS) -> StepGraphs | EagerStep:
    """`--graphs off` -> EagerStep; `on` / `check` -> StepGraphs. `ngram_ring_slots`: most n-gram
    gradients held at once (ngram_cycle * grad_accum_steps micro-steps)."""
    if config.mode == "off":
        return EagerStep(model, optimizer, step_keys, ngram_table, value_embeds,
                         adam_every=adam_every, grad_accum_steps=grad_accum_steps,
                         ngram_ring_slots=ngram_ring_slots)
    return StepGraphs(model, optimizer, step_keys, ngram_table, value_embeds, max_step_tokens,
                      adam_every=adam_every, grad_accum_steps=grad_accum_steps, config=config,
                      backend=backend, device=device, ngram_ring_slots=ngram_ring_slots)
