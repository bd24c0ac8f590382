"""OptimizerGraphs logic on CPU, over the CUDA-graph stand-in (capture_support.RecordingGraphBackend).

Scope: replay vs the eager AnvilAndAdam over 10 steps of every cadence (ANVIL-only, Adam tied, the
untie, Adam untied) with lr and momentum changing every step, for both gradient-input modes
("stage": fresh p.grad tensors every step; "adopt": persistent ones), eager and compiled
(aot_eager) update functions; the self-check catching a replay that leaves a state tensor stale
and a replay that baked the capture step's values; the adopt guard naming a moved p.grad and a
moved gradient buffer; a missing gradient; seal() with an unchecked or never-captured cadence and a
new cadence after seal; the census (as take_census's second source) passing an in-place reset and
naming a rebound state tensor; the factory (off, world size > 1, an optimizer without run_step),
the trainer-facing passthroughs; a capture-forbidden operation reported as a CaptureError naming
the cadence; cover_cadences (incl. the speedrun plan, which needs no extra
visit). The model is tests/test_anvil_math.Tiny (every bank and Adam kind of the real table).
What the stand-in cannot show (a graph that baked a Python value or an address; no host sync in a
replay) is tested in tests/test_optimizer_graphs_gpu.py.
Hardware: CPU only (~20 s on 2 busy cores, most of it the aot_eager cases).
Run: `.venv/bin/python -m pytest tests/test_optimizer_graphs.py -q`.
"""

import pytest
import torch

from tests.test_anvil_fused import _opt
from tests.test_anvil_math import SPEEDRUN, Tiny
from track_1_short.optim.adamw_baseline import AdamWBaseline
from track_1_short.perf.cuda_graphs.baked_addresses import CensusError, compare, take_census
from track_1_short.perf.cuda_graphs.capture_plan import warmup_visit_plan
from track_1_short.perf.cuda_graphs.capture_support import CaptureError, RecordingGraphBackend
from track_1_short.perf.cuda_graphs.optimizer_graphs import (
    Cadence, EagerOptimizer, OptimizerGraphError, OptimizerGraphs, OptimizerGraphsConfig,
    cover_cadences, make_optimizer_graphs, step_cadences)
from track_1_short.schedule import Schedule, ScheduleConfig

ANVIL, TIED, UNTIED = Cadence(False, False), Cadence(True, True), Cadence(True, False)
UNTIE_AFTER = 3
PLANS = [SPEEDRUN.plan(step) for step in range(64)]  # the cadences: Adam on odd steps


class Producer:
    """Stands in for the step runner's gradient handoff: seeded random gradients every step.
    persistent: one buffer per parameter, copied into on the first step of its accumulation cycle
    and added into while the optimizer keeps .grad (GradHandoff with micro_steps > 1); else
    fresh tensors (eager autograd). value_embeds' gradient goes to the optimizer's grad buffer."""

    def __init__(self, model, opt, seed: int, persistent: bool):
        self.model, self.persistent = model, persistent
        self.ve_buffer = opt.grad_buffers[model.value_embeds.weight]
        self.device = self.ve_buffer.device  # a generator there: no host-to-device copy on CUDA
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.buffers: dict[str, torch.Tensor] = {}

    def __call__(self):
        for name, p in self.model.named_parameters():
            g = torch.randn(p.shape, generator=self.gen, device=self.device)
            if p is self.model.value_embeds.weight:
                self.ve_buffer.add_(g)
                continue
            g = g.to(p.dtype)
            if not self.persistent:
                p.grad = g if p.grad is None else p.grad + g
                continue
            buf = self.buffers.setdefault(name, torch.zeros_like(p))
            buf.copy_(g) if p.grad is None else buf.add_(g)  # p.grad is buf while kept
            p.grad = buf


def _lr(step):
    return 1.0 - 0.05 * step


def _momentum(step):
    return 0.85 + 0.01 * step


def step_once(opt, step, lr=None):
    """train_step's optimizer call: lr and momentum change every step, Adam on the plan's steps."""
    opt.step(step, _lr(step) if lr is None else lr, _momentum(step), PLANS[step].adam_step)


def run(opt, producer, steps, seal_after=None):
    """train_step's optimizer calls (step_once); untie after UNTIE_AFTER."""
    for step in steps:
        producer()
        step_once(opt, step)
        if step == UNTIE_AFTER and opt.tied:
            opt.untie_embed_head()
        if step == seal_after:
            opt.seal()


def make(grad_inputs="stage", compile=False, dtype=torch.float32, backend=None, **kw):
    """(model, OptimizerGraphs over a fresh AnvilAndAdam, its producer)."""
    model = Tiny(dtype=dtype)
    opt = _opt(model, **(dict(compile=True, compile_backend="aot_eager") if compile else {}))
    graphs = OptimizerGraphs(opt, OptimizerGraphsConfig(grad_inputs=grad_inputs),
                             backend=backend or RecordingGraphBackend(), **kw)
    return model, graphs, Producer(model, opt, seed=40, persistent=grad_inputs == "adopt")


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("grad_inputs", ["stage", "adopt"])
def test_replay_matches_eager_over_both_cadences_and_the_untie(grad_inputs, compile):
    torch._dynamo.reset()
    model, graphs, producer = make(grad_inputs, compile, plans=PLANS[:10], untie_step=UNTIE_AFTER)
    twin = Tiny()
    eager = _opt(twin, **(dict(compile=True, compile_backend="aot_eager") if compile else {}))
    run(eager, Producer(twin, eager, seed=40, persistent=False), range(10))
    run(graphs, producer, range(10), seal_after=7)
    # visits: 0 2 4 6 8 anvil, 1 3 tied (untie after 3), 5 7 9 untied; captured at each first visit
    # (+1 replay), self-checked at the second, plain replays after
    assert {c: g.graph.num_replays for c, g in graphs.captured.items()} == {ANVIL: 5, TIED: 2, UNTIED: 3}
    assert all(g.checked for g in graphs.captured.values()) and graphs.sealed
    assert {r["cadence"]: r["self_checks"] for r in graphs.capture_report()} == {
        "anvil": 1, "adam_tied": 1, "adam_untied": 1}
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)
    for (role, t), (_, u) in zip(eager.named_state_tensors(), graphs.optimizer.named_state_tensors()):
        torch.testing.assert_close(u, t, rtol=1e-6, atol=1e-7, msg=role)
    assert graphs.tied is None and graphs.optimizer.adam_steps == eager.adam_steps == 5


def test_self_check_catches_a_state_tensor_the_replay_does_not_update():
    model, graphs, producer = make()
    run(graphs, producer, range(2))
    graph = graphs.captured[ANVIL].graph
    momentum = graphs.optimizer.banks[0].momentum  # qk_bank's
    replay = graph._replay

    def stale_momentum_replay():
        kept = momentum.clone()
        replay()
        momentum.copy_(kept)

    graph._replay = stale_momentum_replay
    with pytest.raises(OptimizerGraphError, match=r"step 2: optimizer graph anvil: replayed "
                                                  r"optimizer\.banks\.qk_bank\.momentum differs"):
        run(graphs, producer, [2])


class FrozenValuesBackend(RecordingGraphBackend):
    """Stands in for a graph that baked the per-step values (a CPU scalar launch argument would be):
    its replays run with the step values of the capture, whatever the host wrote since."""

    def __init__(self):
        self.step_values = None

    def capture_call(self, graph, fn, **kw):
        frozen = self.step_values.clone()

        def baked():
            live = self.step_values.clone()
            self.step_values.copy_(frozen)
            fn()
            self.step_values.copy_(live)

        return super().capture_call(graph, baked, **kw)


def test_self_check_catches_a_replay_with_the_capture_steps_values():
    backend = FrozenValuesBackend()
    model, graphs, producer = make(backend=backend)
    backend.step_values = graphs.optimizer.step_values.values
    run(graphs, producer, range(2))  # lr 1.0 / momentum 0.85 at capture, 0.9 / 0.87 at step 2
    with pytest.raises(OptimizerGraphError, match=r"step 2: optimizer graph anvil: replayed .* "
                                                  r"differs from an eager run_step"):
        run(graphs, producer, [2])


class SyncInCaptureBackend(RecordingGraphBackend):
    """Its capture fails the way CUDA fails a host sync inside a captured region."""

    def capture_call(self, graph, fn, **kw):
        def sync():
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return super().capture_call(graph, sync, **kw)


def test_capture_error_names_the_cadence():
    model, graphs, producer = make(backend=SyncInCaptureBackend())
    producer()
    with pytest.raises(CaptureError, match=r"capture of the step of optimizer graph anvil failed: a "
                                           r"host sync .* inside the captured callable"):
        step_once(graphs, 0, lr=1.0)


def test_adopt_guard_names_a_moved_gradient_and_a_moved_grad_buffer():
    model, graphs, producer = make("adopt")
    run(graphs, producer, range(4), seal_after=3)
    producer()
    model.qk_bank.grad = model.qk_bank.grad.clone()  # a new buffer: the graph would read the old one
    with pytest.raises(OptimizerGraphError, match=r"step 4: optimizer graph anvil: p\.grad of qk_bank "
                                                  r"is at 0x[0-9a-f]+, the graph reads 0x"):
        step_once(graphs, 4, lr=1.0)
    model, graphs, producer = make("stage")
    run(graphs, producer, range(3))  # adam_tied captured at step 1
    ve = model.value_embeds.weight
    graphs.optimizer.grad_buffers[ve] = graphs.optimizer.grad_buffers[ve].clone()
    producer()
    with pytest.raises(OptimizerGraphError, match=r"step 3: optimizer graph adam_tied: the gradient "
                                                  r"buffer of value_embeds\.weight moved"):
        step_once(graphs, 3, lr=1.0)


def test_stage_copies_this_steps_gradients_and_names_a_missing_one():
    model, graphs, producer = make("stage")
    run(graphs, producer, range(3))
    staged = graphs.grad_inputs[model.qk_bank]
    assert graphs.captured[ANVIL].inputs[0] is staged and graphs.captured[TIED].inputs[0] is staged
    producer()
    assert model.qk_bank.grad is not staged  # a fresh tensor every step
    expected = model.qk_bank.grad.clone()
    step_once(graphs, 3, lr=1.0)
    assert torch.equal(staged, expected)
    producer()
    model.mlp_bank.grad = None
    with pytest.raises(OptimizerGraphError, match=r"step 4: mlp_bank has no gradient .* anvil step"):
        step_once(graphs, 4, lr=1.0)


def test_seal_demands_checked_captures_of_every_cadence():
    model, graphs, producer = make()
    run(graphs, producer, range(3))
    with pytest.raises(OptimizerGraphError, match=r"never self-checked: \['adam_tied'\]"):
        graphs.seal()
    model, graphs, producer = make(plans=PLANS[:10], untie_step=UNTIE_AFTER)
    run(graphs, producer, range(4))
    with pytest.raises(OptimizerGraphError, match=r"never captured for cadences \['adam_untied'\] "
                                                  r"\(first steps \[5\]\)"):
        graphs.seal()
    model, graphs, producer = make()  # without plans: only the cadences seen
    run(graphs, producer, range(5), seal_after=3)
    producer()
    with pytest.raises(OptimizerGraphError, match=r"step 5: no optimizer graph for cadence "
                                                  r"adam_untied after seal\(\)"):
        step_once(graphs, 5, lr=1.0)


class _NoRunner:
    def baked_tensors(self):
        return iter(())


def _rebind_momentum(graphs):
    graphs.optimizer.banks[0].momentum = graphs.optimizer.banks[0].momentum.clone()


def _rebind_master(graphs):
    head = graphs.optimizer.adam_by_param[graphs.optimizer.tied_initial[1].param]
    head.master = head.master.clone()


def _rebind_step_values(graphs):
    graphs.optimizer.step_values.values = graphs.optimizer.step_values.values.clone()


def _rebind_grad_input(graphs):
    p = graphs.optimizer.banks[1].param
    graphs.grad_inputs[p] = graphs.grad_inputs[p].clone()


@pytest.mark.parametrize("rebind, role", [
    (_rebind_momentum, "optimizer.banks.qk_bank.momentum"),
    (_rebind_master, "optimizer.adam.lm_head.master"),
    (_rebind_step_values, "optimizer.step_values"),
    (_rebind_grad_input, "optimizer_graphs.grad_input[vo_bank]"),
])
def test_census_passes_an_in_place_reset_and_names_a_rebound_tensor(rebind, role):
    model, graphs, producer = make(dtype=torch.bfloat16)  # bf16: fp32 masters
    run(graphs, producer, range(4), seal_after=3)
    before = take_census(model, _NoRunner(), graphs)
    assert {"baked:optimizer.banks.mlp_bank.lr_mul", "baked:optimizer.step_values",
            "baked:optimizer.grad_buffers[value_embeds.weight]",
            "baked:optimizer_graphs.grad_input[embed.weight]"} <= before.entries.keys()
    graphs.reset()
    compare(before, take_census(model, _NoRunner(), graphs))
    rebind(graphs)
    escaped = role.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(CensusError, match=rf"changed baked:{escaped}: ptr 0x[0-9a-f]+ .* -> ptr"):
        compare(before, take_census(model, _NoRunner(), graphs))


def test_adopt_census_lists_the_held_gradients():
    model, graphs, producer = make("adopt")
    run(graphs, producer, range(2))
    roles = dict(graphs.baked_tensors())
    assert roles["optimizer_graphs.adam_tied.grad[lm_head]"] is producer.buffers["lm_head"]
    assert not any(r.startswith("optimizer_graphs.grad_input") for r in roles)


def _copy_state(sd: dict) -> dict:
    return {k: ({n: {f: t.clone() if torch.is_tensor(t) else t for f, t in fields.items()}
                 for n, fields in v.items()} if k in ("banks", "adam") else v) for k, v in sd.items()}


def test_reset_and_load_state_dict_through_the_wrapper_keep_the_graphs():
    model, graphs, producer = make(plans=PLANS[:10], untie_step=UNTIE_AFTER)
    opt = graphs.optimizer
    assert graphs.param_cfgs is opt.param_cfgs and graphs.tied is opt.tied
    twin = Tiny()
    eager = _opt(twin)
    run(eager, Producer(twin, eager, seed=40, persistent=False), range(10))
    run(graphs, producer, range(8), seal_after=7)
    saved = _copy_state(graphs.state_dict())
    graphs.reset()  # in place: zero moments, re-tied
    assert graphs.tied is not None and opt.adam_steps == 0
    graphs.load_state_dict(saved)
    assert graphs.tied is None and opt.adam_steps == 4
    run(graphs, producer, [8, 9])  # replays of the loaded state
    assert graphs.captured[UNTIED].graph.num_replays == 3
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)


def test_factory_modes():
    model = Tiny()
    opt = _opt(model)
    off = make_optimizer_graphs(opt, OptimizerGraphsConfig(mode="off"))
    assert isinstance(off, EagerOptimizer) and off.capture_report() == [] and off.optimizer is opt
    on = make_optimizer_graphs(opt, OptimizerGraphsConfig(), backend=RecordingGraphBackend(),
                               plans=PLANS[:4], untie_step=None)
    assert isinstance(on, OptimizerGraphs) and on.step_cadences == [ANVIL, TIED, ANVIL, TIED]
    with pytest.raises(ValueError, match="need CUDA parameters"):
        make_optimizer_graphs(opt, OptimizerGraphsConfig())
    opt.world_size = 2  # only the factory's decision is exercised
    with pytest.warns(UserWarning, match="world size 2 > 1: the optimizer's collectives stay eager"):
        wide = make_optimizer_graphs(opt, OptimizerGraphsConfig(mode="check"))
    assert isinstance(wide, EagerOptimizer) and "world size 2" in wide.capture_report()[0]["reason"]
    with pytest.raises(ValueError, match="world size 2 > 1 keeps the collectives eager"):
        OptimizerGraphs(opt, backend=RecordingGraphBackend())
    adamw = AdamWBaseline(model.named_parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match="AdamWBaseline has no capture-ready run_step"):
        baseline = make_optimizer_graphs(adamw, OptimizerGraphsConfig())
    assert baseline.tied is None


def test_eager_wrapper_is_the_optimizers_step():
    model, twin = Tiny(), Tiny()
    opt, ref = _opt(model), _opt(twin)
    wrapped = make_optimizer_graphs(opt, OptimizerGraphsConfig(mode="off"))
    run(wrapped, Producer(model, opt, seed=41, persistent=False), range(6))
    run(ref, Producer(twin, ref, seed=41, persistent=False), range(6))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert list(wrapped.baked_tensors()) == [] and wrapped.tied is None


def test_config_validation():
    for kw, match in [(dict(mode="fast"), "mode='fast'"), (dict(grad_inputs="copy"), "grad_inputs"),
                      (dict(check_fraction=2.0), "check_fraction"),
                      (dict(self_check_rel=-1.0), "self_check_rel"),
                      (dict(warm_iterations=0), "warm_iterations")]:
        with pytest.raises(ValueError, match=match):
            OptimizerGraphsConfig(**kw)


def test_cover_cadences_adds_the_missing_visits():
    opt = _opt(Tiny())
    cadences = step_cadences(opt, PLANS[:20], untie_step=11)
    assert cadences[11] == TIED and cadences[13] == UNTIED and cadences[12] == ANVIL
    assert cover_cadences([0, 1, 2, 3, 10, 11], cadences, 11) == [0, 1, 2, 3, 10, 11, 13, 15]
    short = step_cadences(opt, PLANS[:14], untie_step=11)
    assert cover_cadences([0, 1, 2, 3, 11], short, 11) == [0, 1, 2, 3, 11, 13, 13]  # visited twice
    with pytest.raises(ValueError, match="served only by the untie step 1"):
        cover_cadences([0, 1, 2], step_cadences(opt, PLANS[:3], untie_step=1), 1)


def test_speedrun_warmup_plan_already_covers_every_cadence():
    speedrun = Schedule(ScheduleConfig())
    untie = speedrun.stage_starts[2] | 1  # trainer/build.untie_step
    cadences = step_cadences(_opt(Tiny()), [speedrun.plan(s) for s in range(speedrun.num_steps)],
                             untie)
    visits = warmup_visit_plan(speedrun)
    assert cover_cadences(visits, cadences, untie) == visits
    assert sorted({str(cadences[v]) for v in visits}) == ["adam_tied", "adam_untied", "anvil"]
