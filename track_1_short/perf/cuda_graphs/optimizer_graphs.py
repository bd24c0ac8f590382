"""CUDA graphs of the optimizer step: AnvilAndAdam.run_step captured once per cadence, checked like
the step graphs.

What it replaces: launching AnvilAndAdam's device half from Python every step, ~100+ small kernels
(eager, 1 GPU, stage C: ~10 ms on an ANVIL-only step and ~20 ms on an Adam step before compile; the
record's trainer 4.3 / 7.3 ms), all of it host time on every step. Why it is faster: a replay
launches the whole device half at once, so the host cost of the step drops to write_step_values
(one pinned-ring H2D copy), a few pointer checks and one replay, and the host runs ahead of the
device. Not measured yet (no GPU run of this module; tests/test_optimizer_graphs_gpu.py checks
correctness, capture_report() gives eager vs replay ms per cadence once it runs).

What is captured: `AnvilAndAdam.run_step(step, adam_step)` (the one definition: warm iterations,
capture, self-check and the eager path all call it), one graph per CADENCE, read from the
schedule's plan (StepPlan.adam_step, passed to step() by train_step; `plans` at construction gives
every step's, for seal() and the warmup's coverage) and the tie state:
    anvil        an ANVIL-only step (the banks; the tie does not enter: run_step reads it only on
                 Adam steps, so tied and untied ANVIL steps share one graph)
    adam_tied    an Adam step while embed and lm_head are tied (lm_head carries embed's gradient)
    adam_untied  an Adam step after untie_embed_head()
write_step_values(lr_scale, momentum, adam_step) (the host half) stays eager, before the replay:
its ring slot is not address-stable. zero_grad(adam_step) stays eager after it, unchanged.

Gradient inputs (the choice between a graph per (cadence, gradient addresses) and persistent
gradient buffers): the key is the cadence alone, and the graphs read persistent gradient buffers,
obtained one of two ways (OptimizerGraphsConfig.grad_inputs):
    "stage"  (default) buffers owned here, one per parameter the cadence reads; each step copies
             the live p.grad into them (one _foreach_copy_) before the replay. Works with any
             producer: StepGraphs with one micro-step (each bank's p.grad is that step-graph key's
             own backward output, a different buffer per key), the eager backward (fresh tensors).
             The producer's tensors are only read (the tied lm_head add lands in the staged copy).
             Cost: that copy, at the speedrun's shapes ~167 MB of bf16 bank gradients every step
             plus ~155 MB of embed/lm_head gradients on Adam steps (read + write: ~0.1-0.2 ms at
             H200 bandwidth, estimated, not measured), and ~322 MB more memory.
    "adopt"  the graphs read the p.grad tensors they saw at capture, with no copy; every replay
             checks that each live p.grad has the captured data_ptr and raises naming the
             parameter otherwise. Right when the producer hands persistent buffers: StepGraphs /
             EagerStep with micro_steps > 1 (1 GPU: 8 micro-steps), whose GradHandoff gives
             every parameter a persistent accumulator.
The alternative, one graph per (cadence, gradient addresses), was not taken: with one micro-step
it multiplies the graphs by the step-graph keys, and the warmup cannot check the (last key, Adam
tied) graph at all, because only the untie step serves it and its second visit runs untied.
Gradient buffers set with set_grad_buffer (value_embeds' ValueEmbedPull.grad_accum) are always
read in place (run_step zeroes them after consuming them; a copy would never be zeroed) and their
data_ptrs are checked at every replay in both modes.

Capture protocol (warmup): the first visit of a cadence snapshots every tensor run_step touches
(parameters, optimizer state, gradient inputs, gradient buffers), runs `warm_iterations` eager
run_steps on the capture stream (the first compiles anvil_math's step functions; the later ones run
under set_sync_debug_mode("error") with sync_debug_warmup), restores the snapshot, captures,
restores again (the CPU stand-in's capture executes), and replays: the visit applies exactly one
update. The second visit snapshots, replays, keeps the replay's result, restores, runs run_step
eagerly from the same state and compares every touched tensor: ||replay - eager|| <= self_check_rel
* max(||eager - before||, 1e-6 ||eager||) (the scale is what the step changed, so a tensor the
replay left stale fails at ratio ~1), raising OptimizerGraphError naming the tensor. The state is
then left as the EAGER run left it. The snapshot and the replay's result are device clones of
everything touched (warmup only; at the speedrun's shapes ~6 GB each, estimated). seal() after the warmup: every
cadence seen (and every cadence of the run, given the plans) has a checked capture; a cadence
without one afterwards is fatal.
Mode "check" repeats the full check on the timed steps step_graphs.sampled_check_steps picks.

What must stay address-stable: every tensor baked_tensors() lists (the optimizer's state tensors,
step values, masters, lr multipliers, gradient buffers, the gradient inputs): reset(),
load_state_dict() and untie_embed_head() write in place (AnvilAndAdam's contract), so they pass
through unchanged. baked_addresses.take_census(model, runner, optimizer) censuses them.

World size > 1: not captured. run_step interleaves async reduce-scatters, all_reduces and
all_gathers with the per-shard updates (reductions first, each wait right before its consumer,
each gather launched as its shard finishes). Capturing only the math between eager collectives
would need a graph per bank/table update with an eager wait or launch between replays: the device
overlap would survive, but the host saving is small (each compiled update is already a few
kernels), and NCCL inside a graph, which would capture all of it, needs multi-GPU tests this
machine cannot run. make_optimizer_graphs returns the EagerOptimizer there, with a warning (rank 0)
and a capture_report row that say so.

Call order (trainer): build the optimizer -> make_optimizer_graphs(...) -> warmup visits
(warmup_visits() adds the steps cover_cadences needs) with optimizer.step() in train_step ->
post-warmup reset -> census with the optimizer as a second source -> runner.seal(),
optimizer.seal() -> timed steps.

Provenance: the step-graph protocol of perf/cuda_graphs/step_graphs.py (record #360's
`_CGraphRunner`, via shared/reference/step_graphs_seed.py), applied to the optimizer made
capture-ready in optim/anvil.py. Deviations from the step graphs: the key is a cadence, not a
shape; the self-check compares a whole state (not a loss) and needs snapshot + restore, since the
step writes its inputs.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn

from track_1_short.perf.cuda_graphs.capture_support import (
    CudaGraphBackend, GraphBackend, StepGraphError, paused_gc, warm_up)
from track_1_short.perf.cuda_graphs.step_graphs import GRAPH_MODES, sampled_check_steps

if TYPE_CHECKING:
    from track_1_short.schedule import StepPlan

# Replay vs eager run the same kernels on the same state; this bounds rounding differences only
# (the step graphs' gradient tolerance); a stale or baked replay is off by ~1 (see the docstring).
SELF_CHECK_REL = 1e-2
SELF_CHECK_FLOOR = 1e-6  # of ||eager||: the scale for a tensor the step leaves (almost) unchanged
# The first compiles anvil_math's step functions, the second runs the compiled code as captured.
WARM_ITERATIONS = 2
GRAD_INPUTS = ("stage", "adopt")


class OptimizerGraphError(StepGraphError):
    """A guard protecting optimizer-graph replays failed (explicit raise: survives python -O)."""


@dataclass(slots=True, kw_only=True)
class OptimizerGraphsConfig:
    """The optimizer graphs' knobs; mode, check_fraction and seed follow `--graphs`
    (StepGraphsConfig)."""

    mode: str = "on"  # on: graphs; off: EagerOptimizer; check: graphs + sampled timed self-checks
    grad_inputs: str = "stage"  # "stage": copy p.grad into owned buffers; "adopt": read p.grad in place
    check_fraction: float = 0.01  # share of timed steps self-checked in mode "check"
    seed: int = 0  # seeds the checked steps (the step graphs' seed: the same steps)
    self_check_rel: float = SELF_CHECK_REL
    warm_iterations: int = WARM_ITERATIONS
    sync_debug_warmup: bool = True  # warm iterations after the first under sync debug "error"

    def __post_init__(self):
        if self.mode not in GRAPH_MODES:
            raise ValueError(f"OptimizerGraphsConfig.mode={self.mode!r} must be one of {GRAPH_MODES}")
        if self.grad_inputs not in GRAD_INPUTS:
            raise ValueError(f"OptimizerGraphsConfig.grad_inputs={self.grad_inputs!r} must be one of "
                             f"{GRAD_INPUTS}")
        if not 0.0 <= self.check_fraction <= 1.0:
            raise ValueError(f"OptimizerGraphsConfig.check_fraction={self.check_fraction} must be "
                             f"in [0, 1]")
        if self.self_check_rel < 0:
            raise ValueError(f"OptimizerGraphsConfig.self_check_rel={self.self_check_rel} must be >= 0")
        if self.warm_iterations < 1:
            raise ValueError(f"OptimizerGraphsConfig.warm_iterations={self.warm_iterations} must be "
                             f">= 1 (the first compiles; a compile cannot be captured)")


class Cadence(NamedTuple):
    """What run_step's Python control flow depends on: the graph key."""

    adam: bool  # an Adam step (StepPlan.adam_step)
    tied: bool  # embed/lm_head tied on this Adam step (always False on ANVIL-only steps)

    def __str__(self) -> str:
        return "adam_tied" if self.tied else "adam_untied" if self.adam else "anvil"


def live_cadence(optimizer, adam_step: bool) -> Cadence:
    return Cadence(adam=adam_step, tied=adam_step and optimizer.tied is not None)


def step_cadences(optimizer, plans: Sequence[StepPlan], untie_step: int | None) -> list[Cadence]:
    """The cadence of every step of a run (plans: the schedule's, indexed by step): Adam on
    plan.adam_step, tied from the start (when the optimizer has a tied_embed_head) up to and
    including `untie_step` (train_step unties after its update)."""
    tied_at_start = getattr(optimizer, "tied_initial", None) is not None
    return [Cadence(adam=plan.adam_step, tied=plan.adam_step and tied_at_start
                    and (untie_step is None or plan.step <= untie_step)) for plan in plans]


def cover_cadences(visits: Iterable[int], cadences: list[Cadence], untie_step: int | None) -> list[int]:
    """The warmup visits (sorted, repeats kept) extended so every cadence of the run is visited at
    least twice: the first visit captures, the second checks. A cadence with a single step is
    visited at it twice, except the untie step, whose second visit would run untied."""
    visits = sorted(v for v in visits if v < len(cadences))
    present = set(visits)
    for cadence in dict.fromkeys(cadences):
        served = [step for step, c in enumerate(cadences) if c == cadence]
        count = sum(1 for v in visits if cadences[v] == cadence)
        for step in served:
            if count >= 2:
                break
            if step not in present:
                visits.append(step)
                present.add(step)
                count += 1
        if count < 2:
            if served == [untie_step]:
                raise ValueError(f"cadence {cadence} is served only by the untie step {untie_step}, "
                                 f"which the warmup cannot visit twice tied; move the untie step")
            visits.append(served[0])
    return sorted(visits)


@dataclass(slots=True)
class CadenceStats:
    cadence: str
    capture_s: float
    pool_mib_added: float | None  # None on the CPU stand-in
    eager_ms: float  # last warm iteration of run_step, synchronized
    replay_ms: float | None = None  # the first self-check's replay, synchronized
    replays: int = 0
    self_checks: int = 0
    max_rel_err: float | None = None


@dataclass(slots=True)
class CapturedCadence:
    cadence: Cadence
    graph: Any  # CUDAGraph (or FakeGraph)
    params: list[nn.Parameter]  # whose p.grad run_step reads, in order
    inputs: list[Tensor]  # what the graph reads for each: staged buffer, or the adopted p.grad
    ptrs: tuple[int, ...]  # inputs' data_ptrs ("adopt": each live p.grad must have them)
    buffers: list[tuple[nn.Parameter, int]]  # set_grad_buffer buffers read, with their data_ptrs
    checked: bool = False


class _OptimizerFront:
    """The trainer-facing interface of the wrapped optimizer, passed through unchanged (AnvilAndAdam;
    the AdamW baseline where it has the attribute)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def tied(self):
        return getattr(self.optimizer, "tied", None)

    @property
    def param_cfgs(self) -> dict:
        return self.optimizer.param_cfgs

    @property
    def grad_buffers(self) -> dict:
        return self.optimizer.grad_buffers

    def set_grad_buffer(self, param: nn.Parameter, buffer: Tensor) -> None:
        self.optimizer.set_grad_buffer(param, buffer)

    def zero_grad(self, adam_step: bool) -> None:
        self.optimizer.zero_grad(adam_step)

    def untie_embed_head(self) -> None:
        self.optimizer.untie_embed_head()  # in place: the graphs stay valid

    def reset(self) -> None:
        self.optimizer.reset()  # in place

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)  # copies into the existing buffers

    def warmup_visits(self, visits: Iterable[int]) -> list[int]:
        """The warmup visit plan this optimizer needs (EagerOptimizer: unchanged)."""
        return list(visits)


class EagerOptimizer(_OptimizerFront):
    """`--graphs off` (and world size > 1, or an optimizer without run_step): the optimizer's own
    step(), same interface as OptimizerGraphs. `reason`: why graphs were asked for and not used."""

    def __init__(self, optimizer, reason: str | None = None):
        super().__init__(optimizer)
        self.reason = reason

    def step(self, step: int, lr_scale: float, momentum: float, adam_step: bool) -> None:
        self.optimizer.step(step, lr_scale, momentum, adam_step)

    def seal(self) -> None:
        pass

    def baked_tensors(self) -> Iterator[tuple[str, Tensor]]:
        return iter(())

    def capture_report(self) -> list[dict]:
        return [] if self.reason is None else [{"optimizer_graphs": "eager", "reason": self.reason}]


class OptimizerGraphs(_OptimizerFront):
    """Concern: the optimizer's device half as CUDA graphs, one per cadence, with their capture,
    replay and self-checks (see the module docstring). Built once after the optimizer
    (make_optimizer_graphs); train_step calls step() every step."""

    def __init__(self, optimizer, config: OptimizerGraphsConfig | None = None, *,
                 plans: Sequence[StepPlan] | None = None, untie_step: int | None = None,
                 backend: GraphBackend | None = None, device: torch.device | None = None):
        """plans (the schedule's plan of every step of the run) / untie_step (the run's, as
        train_step unties): seal() then demands every cadence of the run and warmup_visits()
        covers them; None: only the cadences seen."""
        super().__init__(optimizer)
        if optimizer.world_size > 1:
            raise ValueError(f"OptimizerGraphs: world size {optimizer.world_size} > 1 keeps the "
                             f"collectives eager; build it with make_optimizer_graphs")
        self.config = config or OptimizerGraphsConfig()
        self.backend = backend or CudaGraphBackend()
        self.stream = self.backend.new_stream(device or optimizer.step_values.values.device)
        self.pool = self.backend.pool_handle()  # replays never overlap: one pool for every cadence
        self.names = {b.param: b.name for b in optimizer.banks}
        self.names.update((a.param, a.name) for a in optimizer.adam_by_param.values())
        self.untie_step = untie_step
        self.step_cadences = None if plans is None else step_cadences(optimizer, plans, untie_step)
        num_steps = None if plans is None else len(plans)
        self.captured: dict[Cadence, CapturedCadence] = {}
        self.stats: dict[Cadence, CadenceStats] = {}
        self.grad_inputs: dict[nn.Parameter, Tensor] = {}  # "stage": the owned gradient buffers
        self.check_steps = (sampled_check_steps(num_steps, self.config.check_fraction,
                                                self.config.seed)
                            if self.config.mode == "check" and num_steps else frozenset())
        self.sealed = False

    # ---- per step ----

    def step(self, step: int, lr_scale: float, momentum: float, adam_step: bool) -> None:
        """write_step_values (eager) -> replay run_step (capture it on a cadence's first warmup
        visit, self-check on its second) -> zero_grad(adam_step) (eager). The arguments are
        AnvilAndAdam.step's: the plan's lr_mul, momentum and adam_step."""
        opt = self.optimizer
        cadence = live_cadence(opt, adam_step)
        opt.write_step_values(lr_scale, momentum, adam_step)  # host half: before the replay reads it
        cap = self.captured.get(cadence)
        if cap is None:
            # Captures are warmup-only: after seal() a missing graph is fatal, never a silent eager step.
            if self.sealed:
                raise OptimizerGraphError(f"step {step}: no optimizer graph for cadence {cadence} "
                                          f"after seal(); the warmup must visit it twice")
            self._capture(step, cadence)
        else:
            self._feed(step, cap)
            if not cap.checked or (self.sealed and step in self.check_steps):
                self._check(step, cap)
            else:
                cap.graph.replay()
                self.stats[cadence].replays += 1
        opt.zero_grad(adam_step)

    def _grad_params(self, cadence: Cadence) -> list[nn.Parameter]:
        """Parameters whose p.grad run_step reads: the banks, plus on Adam steps every Adam
        parameter without a set_grad_buffer buffer (embed too while tied: lm_head adds its grad)."""
        opt = self.optimizer
        params = [b.param for b in opt.banks]
        if cadence.adam:
            params += [a.param for a in opt.adam_group + opt.adam_tables
                       if a.param not in opt.grad_buffers]
        return params

    def _live_grads(self, step: int, cadence: Cadence, params: list[nn.Parameter]) -> list[Tensor]:
        grads = [p.grad for p in params]
        for p, g in zip(params, grads):
            if g is None:
                raise OptimizerGraphError(f"step {step}: {self.names[p]} has no gradient (p.grad is "
                                          f"None) on a {cadence} step; run the backward first")
        return grads

    def _feed(self, step: int, cap: CapturedCadence) -> None:
        """Make the graph's gradient inputs this step's: copy ("stage") or check ("adopt"); and check
        the set_grad_buffer buffers are still the captured ones. Host work only (+ one copy)."""
        grads = self._live_grads(step, cap.cadence, cap.params)
        if self.config.grad_inputs == "stage":
            torch._foreach_copy_(cap.inputs, grads)
        else:
            for p, g, ptr in zip(cap.params, grads, cap.ptrs):
                # A replay reads the captured address: another p.grad would be silently ignored.
                if g.data_ptr() != ptr:
                    raise OptimizerGraphError(
                        f"step {step}: optimizer graph {cap.cadence}: p.grad of {self.names[p]} is at "
                        f"{g.data_ptr():#x}, the graph reads {ptr:#x} (grad_inputs='adopt' needs a "
                        f"persistent gradient buffer per parameter; use grad_inputs='stage')")
        for p, ptr in cap.buffers:
            buffer = self.optimizer.grad_buffers.get(p)
            if buffer is None or buffer.data_ptr() != ptr:
                raise OptimizerGraphError(
                    f"step {step}: optimizer graph {cap.cadence}: the gradient buffer of "
                    f"{self.names[p]} moved since capture ({ptr:#x}); set_grad_buffer must be "
                    f"called once, before the first step")

    def _point_grads(self, cap: CapturedCadence) -> None:
        """Before an eager run_step of the warmup: p.grad = the graph's inputs (no-op for "adopt")."""
        for p, g in zip(cap.params, cap.inputs):
            p.grad = g

    # ---- capture and checks (warmup only, and mode "check") ----

    def _new_capture(self, step: int, cadence: Cadence) -> CapturedCadence:
        opt = self.optimizer
        params = self._grad_params(cadence)
        grads = self._live_grads(step, cadence, params)
        if self.config.grad_inputs == "stage":
            for p, g in zip(params, grads):
                if p not in self.grad_inputs:
                    self.grad_inputs[p] = torch.empty_like(g)
            inputs = [self.grad_inputs[p] for p in params]
        else:
            inputs = grads
        buffers = [(p, b.data_ptr()) for p, b in opt.grad_buffers.items()] if cadence.adam else []
        cap = CapturedCadence(cadence=cadence, graph=self.backend.new_graph(), params=params,
                              inputs=inputs, ptrs=tuple(t.data_ptr() for t in inputs),
                              buffers=buffers)
        self._feed(step, cap)
        self._point_grads(cap)
        return cap

    def _touched(self, cap: CapturedCadence) -> dict[str, Tensor]:
        """Every tensor run_step may write (W = 1): parameters, optimizer state, gradient inputs
        (lm_head's is added into while tied) and set_grad_buffer buffers (zeroed after use)."""
        opt = self.optimizer
        out = {f"param[{self.names[p]}]": p.data for p in opt.param_cfgs}
        out.update((role, t) for role, t in opt.named_state_tensors()
                   if t is not opt.step_values.values)  # read-only
        out.update((f"grad_input[{self.names[p]}]", g) for p, g in zip(cap.params, cap.inputs))
        if cap.cadence.adam:
            out.update((f"grad_buffer[{self.names[p]}]", b) for p, b in opt.grad_buffers.items())
        return out

    def _capture(self, step: int, cadence: Cadence) -> None:
        """Warm up, capture and replay once: this visit applies exactly one update."""
        start = time.perf_counter()
        cap = self._new_capture(step, cadence)
        touched = self._touched(cap)
        before = _clone(touched)

        def run():  # the one definition: warm iterations, capture and check all run it
            self.optimizer.run_step(step, cadence.adam)
        eager_ms = warm_up(self.backend, self.stream, run, self.config.warm_iterations,
                           self.config.sync_debug_warmup)
        _restore(touched, before)
        with paused_gc():
            pool_bytes = self.backend.capture_call(cap.graph, run, pool=self.pool, stream=self.stream,
                                                   key=str(cadence), graph_kind="optimizer graph")
        _restore(touched, before)  # the CPU stand-in's capture ran the step; a real one recorded it
        del before
        cap.graph.replay()
        self.captured[cadence] = cap
        self.stats[cadence] = CadenceStats(
            cadence=str(cadence), capture_s=time.perf_counter() - start, eager_ms=eager_ms,
            pool_mib_added=None if pool_bytes is None else pool_bytes / 2**20, replays=1)

    def _check(self, step: int, cap: CapturedCadence) -> None:
        """Replay vs eager run_step from the same state, every touched tensor; leaves the eager state."""
        self._point_grads(cap)
        touched = self._touched(cap)
        before = _clone(touched)
        self.backend.synchronize()
        start = time.perf_counter()
        cap.graph.replay()
        self.backend.synchronize()
        replay_ms = (time.perf_counter() - start) * 1e3
        replayed = _clone(touched)
        _restore(touched, before)
        self.optimizer.run_step(step, cap.cadence.adam)
        roles = list(touched)
        errors = _relative_errors([replayed[r] for r in roles], [touched[r] for r in roles],
                                  [before[r] for r in roles])
        worst = max(range(len(errors)), key=errors.__getitem__)
        stats = self.stats[cap.cadence]
        stats.replays += 1
        stats.self_checks += 1
        stats.replay_ms = stats.replay_ms or replay_ms
        stats.max_rel_err = max(stats.max_rel_err or 0.0, errors[worst])
        if not errors[worst] <= self.config.self_check_rel:  # NaN fails too
            raise OptimizerGraphError(
                f"step {step}: optimizer graph {cap.cadence}: replayed {roles[worst]} differs from an "
                f"eager run_step on the same state (relative error {errors[worst]:.3g} > "
                f"{self.config.self_check_rel:.3g}, relative to the step's change): the graph "
                f"baked a per-step value or a stale address, or an op is not capture-safe")
        cap.checked = True

    def seal(self) -> None:
        """After warmup: every cadence seen, and every cadence of the run (given plans), has a
        checked capture; afterwards a cadence without one is fatal."""
        expected = dict.fromkeys(self.step_cadences or ())
        missing = [str(c) for c in expected if c not in self.captured]
        if missing:
            firsts = [self.step_cadences.index(c) for c in expected if c not in self.captured]
            raise OptimizerGraphError(f"seal: optimizer graphs never captured for cadences {missing} "
                                      f"(first steps {firsts}); the warmup must visit each twice "
                                      f"(warmup_visits / cover_cadences)")
        unchecked = [str(c) for c, cap in self.captured.items() if not cap.checked]
        if unchecked:
            raise OptimizerGraphError(f"seal: optimizer graphs never self-checked: {unchecked}; each "
                                      f"cadence needs a second warmup visit")
        self.sealed = True

    def warmup_visits(self, visits: Iterable[int]) -> list[int]:
        """The visits plus the steps cover_cadences adds (unchanged without plans)."""
        if self.step_cadences is None:
            return list(visits)
        return cover_cadences(visits, self.step_cadences, self.untie_step)

    # ---- census and report ----

    def baked_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(role, tensor) of every tensor the graphs read or write that the model's parameters do not
        cover, read live from their owners (a rebind shows)."""
        opt = self.optimizer
        yield from opt.named_state_tensors()  # moments, masters, step values
        for b in opt.banks:
            yield f"optimizer.banks.{b.name}.lr_mul", b.lr_mul
        for p, buffer in opt.grad_buffers.items():
            yield f"optimizer.grad_buffers[{self.names[p]}]", buffer
        for p, buffer in self.grad_inputs.items():
            yield f"optimizer_graphs.grad_input[{self.names[p]}]", buffer
        if self.config.grad_inputs == "adopt":
            # the producer's tensors, held here (every replay checks the live p.grad against them)
            for cap in self.captured.values():
                for p, g in zip(cap.params, cap.inputs):
                    yield f"optimizer_graphs.{cap.cadence}.grad[{self.names[p]}]", g

    def capture_report(self) -> list[dict]:
        """Per cadence: capture seconds, pool MiB, eager vs replay ms, replays, self-checks."""
        rows = []
        for stats in self.stats.values():
            row = dataclasses.asdict(stats)
            row["grad_inputs"] = self.config.grad_inputs
            row["speedup"] = (stats.eager_ms / stats.replay_ms) if stats.replay_ms else None
            rows.append(row)
        return rows


def _clone(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {role: t.clone() for role, t in tensors.items()}


def _restore(tensors: dict[str, Tensor], saved: dict[str, Tensor]) -> None:
    torch._foreach_copy_(list(tensors.values()), [saved[role] for role in tensors])


def _relative_errors(replayed: list[Tensor], eager: list[Tensor], before: list[Tensor]) -> list[float]:
    """||replay - eager|| / max(||eager - before||, SELF_CHECK_FLOOR * ||eager||), one host sync."""
    diff = torch.stack([(r.float() - e.float()).norm() for r, e in zip(replayed, eager)])
    change = torch.stack([(e.float() - b.float()).norm() for e, b in zip(eager, before)])
    size = torch.stack([e.float().norm() for e in eager])
    scale = torch.maximum(change, size * SELF_CHECK_FLOOR).clamp_min(1e-30)
    return (diff / scale).tolist()


def make_optimizer_graphs(optimizer, config: OptimizerGraphsConfig, *,
                          plans: Sequence[StepPlan] | None = None, untie_step: int | None = None,
                          backend: GraphBackend | None = None,
                          device: torch.device | None = None) -> OptimizerGraphs | EagerOptimizer:
    """mode "off" -> EagerOptimizer; "on" / "check" -> OptimizerGraphs, except where the step cannot
    be captured (world size > 1, an optimizer without run_step): EagerOptimizer with a warning."""
    if config.mode == "off":
        return EagerOptimizer(optimizer)
    reason = None
    if not hasattr(optimizer, "run_step"):
        reason = f"{type(optimizer).__name__} has no capture-ready run_step"
    elif optimizer.world_size > 1:
        reason = (f"world size {optimizer.world_size} > 1: the optimizer's collectives stay eager "
                  f"(NCCL inside a graph is untested here), so its whole step runs eagerly")
    if reason is not None:
        if getattr(optimizer, "rank", 0) == 0:  # once in the log, not once per rank
            warnings.warn(f"optimizer graphs not used: {reason}", stacklevel=2)
        return EagerOptimizer(optimizer, reason=reason)
    if backend is None and optimizer.step_values.values.device.type != "cuda":
        raise ValueError("optimizer graphs need CUDA parameters (or the CPU stand-in backend in "
                         "tests); pass --graphs off")
    return OptimizerGraphs(optimizer, config, plans=plans, untie_step=untie_step,
                           backend=backend, device=device)
