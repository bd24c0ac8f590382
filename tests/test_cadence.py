"""One source for every cadence: each consumer agrees with the schedule's StepPlan at every step.

Scope: all 1285 steps of the speedrun schedule (`Schedule(ScheduleConfig())`, through the real
`trainer/build.make_spec`), at the micro-step counts of 1, 2 and 8 ranks (8, 4 and 1 micro-steps
per rank), run through the real `trainer/step.train_step` with the real consumers on tiny tensors:
AnvilAndAdam (one ANVIL bank, a replicated and a table Adam parameter; eager, and captured per
cadence by OptimizerGraphs over the CPU stand-in backend), GradHandoff inside a stand-in runner
(its backward hands over integer-valued gradients, so copy vs add is checked exactly), NgramStore (its rows pulled once per stand-in batch: the row pull is
no cadence consumer), checkpoint.aligned.
Per step it checks that
- the optimizer receives plan.momentum (its StepValues) and updates the Adam parameters exactly on
  plan.adam_step steps (they move then, and only then); the ANVIL bank moves every step;
- GradHandoff copies on micro-step 0 of plan.adam_first steps and adds otherwise: the accumulator
  the optimizer reads always holds the gradients summed since the last Adam step (derived here from
  plan.adam_step, not adam_first);
- the n-gram store's update events are exactly the plan.ngram_event steps, it never holds more than
  its bound (cycle x micro-steps) and reaches it exactly on the last micro-step before each
  regular event (the last step's forced event holds one step's), and what its row accumulator
  holds at an event is the sum of every micro-step's gradient since the last one (each read
  before the runner's next backward overwrote its buffer);
- checkpoint.aligned after the step is exactly "nothing held": no Adam gradient kept (p.grad) and
  no held n-gram gradient; those boundaries are the multiples of the schedule's checkpoint_period.
Hardware: CPU only, a few seconds per micro-step count.
Run: `.venv/bin/python -m pytest tests/test_cadence.py -q`.
"""

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from track_1_short import config as config_mod
from track_1_short.distributed import DistributedContext
from track_1_short.model.ngram_config import NgramConfig
from track_1_short.model.ngram_lookup import NgramLookup
from track_1_short.optim.anvil import AnvilAndAdam, AnvilConfig, build_param_cfgs
from track_1_short.perf.cuda_graphs.capture_support import RecordingGraphBackend, StepGraphError
from track_1_short.perf.cuda_graphs.optimizer_graphs import OptimizerGraphsConfig, make_optimizer_graphs
from track_1_short.perf.cuda_graphs.grad_handoff import GradHandoff
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.trainer import checkpoint
from track_1_short.trainer.build import make_spec
from track_1_short.trainer.state import StepParts
from track_1_short.trainer.step import train_step
from track_1_short.trainer.timing import StepTimer

T, DIM = 4, 4  # tokens per micro-batch, n-gram row width


class _Model(nn.Module):
    """The parameter kinds whose cadences differ: an ANVIL bank, a replicated and a table Adam
    parameter (names from PARAM_TABLE)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.qk_bank = nn.Parameter(torch.randn(2, 4, 4, generator=gen) * 0.2)
        self.scalars = nn.Parameter(torch.randn(3, generator=gen))
        self.embed = nn.Embedding(6, 4)

    def set_yarn_window(self, ws_long: int) -> None:
        """train_step moves YaRN at window changes; nothing here depends on it."""


@dataclass
class _Batch:
    inputs: torch.Tensor  # int32 [T]
    ids: torch.Tensor  # int64 [2T] its n-gram table rows
    slots: torch.Tensor  # int64 [2T] its row-cache slots


class _Loader:
    """Stands in for BatchLoader and RowPrefetch: a few micro-batches, round robin, whose rows
    were pulled once (the table's values do not matter here, only what the store holds)."""

    def __init__(self, store: NgramStore):
        gen = torch.Generator().manual_seed(1)
        self.pool = []
        for _ in range(5):
            inputs = torch.randint(0, 50, (T,), generator=gen, dtype=torch.int32)
            ids = store.lookup.row_ids(inputs)
            self.pool.append(_Batch(inputs, ids, store.slots_for(inputs, ids)))
        self.calls = 0

    def next_batch(self) -> _Batch:
        self.calls += 1
        return self.pool[self.calls % len(self.pool)]

    def slots_for(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = next(b for b in self.pool if b.inputs is inputs)
        return batch.ids, batch.slots

    def issue(self, loader) -> None:
        """RowPrefetch's phase A: nothing to exchange on one rank with pulled rows."""


class _Store(NgramStore):
    """The real store, recording the gradients it was handed and what it holds at each event."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.handed: list[float] = []  # values of the gradients held since the last event
        self.events: dict[int, list[float]] = {}  # step -> the held gradients' values at its event

    def hold(self, ngram_grad, ids):
        self.handed.append(ngram_grad[0, 0].item())
        super().hold(ngram_grad, ids)

    def update_event(self, step: int, lr_scale: float = 1.0):
        # each held gradient is one constant [2T, D] tensor: the accumulator sums them whole
        expected = sum(self.handed) * 2 * T * DIM
        assert self.grad_acc.sum().item() == expected, \
            f"step {step}: the row accumulator does not hold the sum of the held gradients"
        self.events[step], self.handed = self.handed, []
        super().update_event(step, lr_scale)
        assert not self.grad_acc.any() and not self.touched.any(), step


class _Runner:
    """The runner's cadence-bearing part is real (GradHandoff); the compiled forward and backward
    are replaced by integer-valued gradients, so sums are exact. Each backward checks the
    accumulators against the window the plan implies: Adam's restarts after every plan.adam_step
    step, ANVIL's (micro-steps > 1) at every step. The n-gram sink gradient is written into one
    buffer that the next backward overwrites, as a graph's memory is, and each value is unique, so
    a store that kept the buffer instead of reading it shows at the event."""

    def __init__(self, optimizer: AnvilAndAdam, plans, micro_steps: int):
        self.handoff = GradHandoff(optimizer.param_cfgs, plans, micro_steps)
        self.plans, self.micro_steps = plans, micro_steps
        self.params = [(p, c.optim == "adam") for p, c in optimizer.param_cfgs.items()]
        self.window = {p: torch.zeros_like(p) for p, _ in self.params}  # expected p.grad
        self.ngram_grad = torch.zeros(2 * T, DIM)  # [2T, D] "graph memory"
        self.produced: list[tuple[int, float]] = []  # (step, value) of every sink gradient
        self.in_flight: tuple[int, int] | None = None

    def forward(self, step, batch, ngram_slots, cfg, *, micro_step=0):
        self.in_flight = (step, micro_step)
        return torch.zeros(())

    def backward(self) -> torch.Tensor:
        step, micro = self.in_flight
        grads = [(p, torch.full_like(p, float((3 * step + micro + k) % 5 + 1)))
                 for k, (p, _) in enumerate(self.params)]
        opens_adam = micro == 0 and (step == 0 or self.plans[step - 1].adam_step)
        for (p, adam), (_, g) in zip(self.params, grads):
            fresh = opens_adam if adam else micro == 0
            self.window[p] = g.clone() if fresh else self.window[p] + g
        self.handoff.hand_over(step, micro, grads)
        for p, _ in self.params:
            assert torch.equal(p.grad, self.window[p]), \
                f"step {step} micro {micro}: handoff gradient != the plan's window sum"
        value = float(step * self.micro_steps + micro + 1)
        self.produced.append((step, value))
        return self.ngram_grad.fill_(value)


def _build(micro_steps: int, graphs: str, tmp_path):
    cfg = config_mod.preset("speedrun")
    cfg.data = dataclasses.replace(cfg.data, slices_per_step=micro_steps)  # W = 1
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                             backend=None)
    spec = make_spec(cfg, ctx, tmp_path)
    model = _Model()
    optimizer = AnvilAndAdam(build_param_cfgs(model.named_parameters()), AnvilConfig(compile=False))
    store = _Store(NgramLookup(NgramConfig(dim=DIM, bigram_rows=16, trigram_rows=16,
                                           cache_rows=2 * T)),
                   cycle=cfg.schedule.ngram_cycle, micro_steps=spec.micro_steps)
    runner = _Runner(optimizer, spec.plans, spec.micro_steps)
    loader = _Loader(store)
    # as prepare_model wraps it: EagerOptimizer (--graphs off) or OptimizerGraphs (on; the CPU
    # stand-in backend), both fed the plan's cadence by train_step
    wrapped = make_optimizer_graphs(optimizer, OptimizerGraphsConfig(mode=graphs), plans=spec.plans,
                                    untie_step=spec.untie_step, backend=RecordingGraphBackend())
    parts = StepParts(model=model, forward_fn=None, eval_fn=None, optimizer=wrapped,
                      runner=runner, ngram=store, prefetch=loader, prefix_table=None)
    return spec, parts, loader


@pytest.mark.parametrize("micro_steps, graphs", [(8, "off"), (4, "off"), (1, "off"), (1, "on")])
def test_every_consumer_follows_the_plan(micro_steps, graphs, tmp_path):
    """1, 2 and 8 ranks' micro-steps; the optimizer eager and as optimizer graphs."""
    spec, parts, loader = _build(micro_steps, graphs, tmp_path)
    plans, opt, store, model = spec.plans, parts.optimizer.optimizer, parts.ngram, parts.model
    assert len(plans) == spec.schedule.num_steps == 1285 and spec.micro_steps == micro_steps
    assert store.max_held == spec.schedule.cfg.ngram_cycle * micro_steps
    adam = [model.scalars, model.embed.weight]
    timer = StepTimer(torch.device("cpu"))
    held_after = []  # nothing held after step s: no kept Adam gradient, no held n-gram gradient
    for plan in plans:
        step = plan.step
        before = [p.detach().clone() for p in (*adam, model.qk_bank)]
        train_step(spec, parts, step, loader, timer)
        values = opt.step_values.values
        assert values[0].item() == torch.tensor(plan.momentum, dtype=torch.float32).item(), step
        assert abs(values[1].item() - opt.cfg.lr * plan.lr_mul) <= 1e-6 * opt.cfg.lr, step
        moved = [not torch.equal(b, p) for b, p in zip(before, (*adam, model.qk_bank))]
        assert moved == [plan.adam_step, plan.adam_step, True], f"step {step}: {moved}"
        kept_adam = [p.grad is not None for p in adam]
        assert kept_adam == [not plan.adam_step] * 2, f"step {step}: {kept_adam}"
        assert model.qk_bank.grad is None
        if plan.ngram_event:
            assert store.num_pending == 0, step
        else:  # one gradient per micro-step since the last event
            assert store.num_pending == (spec.schedule.ngram_steps_held(step) + 1) * micro_steps
        held_after.append(any(kept_adam) or store.num_pending > 0)
    assert opt.adam_steps == sum(p.adam_step for p in plans)
    if graphs == "on":  # every step replayed a graph of its plan's cadence (no tie here)
        replays = {str(c): s.replays for c, s in parts.optimizer.stats.items()}
        assert replays == {"anvil": sum(not p.adam_step for p in plans),
                           "adam_untied": sum(p.adam_step for p in plans)}, replays
    assert list(store.events) == [p.step for p in plans if p.ngram_event]
    last, produced = plans[-1].step, parts.runner.produced
    for step, held in store.events.items():
        # the bound is reached on the last micro-step before every regular event; the forced
        # event of the last step holds the steps since the previous one
        expected = store.max_held if step != last else \
            (spec.schedule.ngram_steps_held(step) + 1) * micro_steps
        assert len(held) == expected, f"step {step}: {len(held)} held at the event, not {expected}"
        first = step - spec.schedule.ngram_steps_held(step)  # the cycle's first step
        assert held == [v for s, v in produced if first <= s <= step], \
            f"step {step}: the gradients held at the event are not those produced since the last"
    assert max(len(held) for held in store.events.values()) == store.max_held
    assert checkpoint.aligned(plans, 0)
    for steps_done in range(1, len(plans) + 1):
        assert checkpoint.aligned(plans, steps_done) == (not held_after[steps_done - 1]), steps_done
    period = spec.checkpoint_period
    boundaries = [s for s in range(1, len(plans)) if checkpoint.aligned(plans, s)]
    assert boundaries == list(range(period, len(plans), period))
    assert not checkpoint.aligned(plans, len(plans))  # 1284 is even: Adam's window stays open


def test_a_missed_event_is_caught():
    """A consumer that skips an event of the plan fails loudly at the store."""
    store = NgramStore(NgramLookup(NgramConfig(dim=DIM, bigram_rows=16, trigram_rows=16,
                                               cache_rows=2 * T)), cycle=2, micro_steps=4)
    ids = store.lookup.row_ids(torch.arange(T, dtype=torch.int32))
    for _ in range(store.max_held):
        store.hold(torch.zeros(2 * T, DIM), ids)
    with pytest.raises(RuntimeError, match="9 held n-gram gradients > cycle 2 x micro_steps 4"):
        store.hold(torch.zeros(2 * T, DIM), ids)


def test_handoff_rejects_steps_outside_its_plans():
    handoff = GradHandoff({}, [SimpleNamespace(adam_first=True)], 1)
    assert handoff.copies_adam(0, 0)
    with pytest.raises(StepGraphError, match="step 1: outside the 1 planned steps"):
        handoff.copies_adam(1, 0)
    with pytest.raises(StepGraphError, match="micro_step 1 outside"):
        handoff.copies_adam(0, 1)
