"""StepGraphs on a real GPU: replay vs eager for every key, and fault injection.

Scope: the real compiled GPT (GPTConfig.tiny(), fp32 parameters, FlexAttention) captured per key
of a 4-key schedule shaped like the speedrun's (tokens, cu_seqlens length, MTP targets and windows
change between keys; the last two keys share shapes and differ only in windows and YaRN scale).
Checks: the graph's loss equals the uncompiled model's eager loss and every per-step gradient the
backward graph writes is within relative error 1e-2 of autograd's; a rebound parameter fails the
census; an unplanned shape after seal fails naming the key; a value baked into a captured kernel
is caught by the self-check; with varlen_attn the self-check's verdict matches the ground truth;
a host sync inside the capture is reported as a CaptureError naming
the key. What the CPU stand-in cannot show (a baked value, real pool addresses) is tested here.
Hardware: one CUDA GPU (H200 used for the project's evidence); a few minutes, mostly compilation.
Run: `.venv/bin/python -m pytest -m gpu tests/test_step_graphs_gpu.py -q`.

Shapes: T tokens, C cu_seqlens rows, D model dim.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.mp_utils import rerun_in_child
from track_1_short.data import Batch
from track_1_short.perf.cuda_graphs.baked_addresses import CensusError, compare, take_census
from track_1_short.perf.cuda_graphs.capture_plan import step_keys, warmup_visit_plan
from track_1_short.perf.cuda_graphs.capture_support import (
    CaptureError, CudaGraphBackend, StepGraphError, loss_grads)
from track_1_short.optim.anvil_config import build_param_cfgs
from track_1_short.perf.cuda_graphs.step_graphs import (StepGraphs, StepGraphsConfig,
                                                        training_loss)
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.schedule import Schedule, ScheduleConfig, StageConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BOS, VOCAB_REAL = 50256, 50257
GRAD_REL_TOL = 1e-2
LOSS_REL_TOL = 1e-3


def _stage(name, steps, tokens, cu, ws, msl, mtp, extension=False):
    return StageConfig(name=name, num_steps=steps, tokens_per_rank=tokens, ws_short=ws[0],
                       ws_long=ws[1], max_seq_len=msl, cu_seqlens_rows=cu,
                       mtp_weights_start=mtp[0], mtp_weights_end=mtp[1], prefix_weight_start=0.25,
                       prefix_weight_end=0.0, lr_mul=1.0, extension=extension)


SCHEDULE = Schedule(ScheduleConfig(stages=(
    _stage("A", 4, 512, 16, (128, 256), 256, ((1.0, 0.5, 0.25), (1.0, 0.5, 0.0))),
    _stage("B", 4, 1024, 24, (128, 384), 512, ((1.0, 0.5), (1.0, 0.0))),
    _stage("C", 4, 1024, 32, (256, 512), 512, ((1.0,), (1.0,))),
    _stage("D", 2, 1024, 32, (256, 640), 512, ((1.0,), (1.0,)), extension=True),
)))
PLANS = [SCHEDULE.plan(step) for step in range(SCHEDULE.num_steps)]
# the runner's cadences: the plans, one micro-step per step
CADENCE = dict(plans=PLANS, micro_steps=1)


class _Optimizer:
    """Only what StepGraphs reads: param_cfgs with .optim (no updates: parameters stay fixed)."""

    def __init__(self, model):
        self.param_cfgs = build_param_cfgs(model.named_parameters())


class _ScaledLoss(nn.Module):
    """Fault injection: multiplies the loss by a Python float, which a captured kernel bakes as an
    argument. Changing `scale` after capture makes the replay stale while eager follows it."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.scale = 1.0

    @property
    def yarn(self):
        return self.inner.yarn

    @property
    def yarn_paired_head(self):
        return self.inner.yarn_paired_head

    @property
    def yarn_wide(self):
        return self.inner.yarn_wide

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs) * self.scale


def _batch(step: int, device) -> Batch:
    plan = SCHEDULE.plan(step)
    g = torch.Generator().manual_seed(1000 + step)
    T, C, msl = plan.tokens_per_rank, plan.cu_seqlens_rows, plan.max_seq_len
    starts, pos = [0], 0
    while pos < T:
        pos = min(T, pos + int(torch.randint(msl // 4, msl + 1, (), generator=g)))
        starts.append(pos)
    assert len(starts) <= C, "test batch has more documents than the key allows"
    cum = torch.tensor(starts + [T] * (C - len(starts)), dtype=torch.int32)  # [C]
    inputs = torch.randint(0, VOCAB_REAL, (T,), generator=g, dtype=torch.int32)  # [T]
    inputs[cum[:-1].long().clamp(max=T - 1)] = BOS
    targets = torch.randint(0, VOCAB_REAL, (T,), generator=g)  # [T]
    return Batch(inputs.to(device), targets.to(device), cum.to(device))


def _cfg(step: int, device):
    from track_1_short.model.gpt import ForwardScheduleConfig
    plan = SCHEDULE.plan(step)
    return ForwardScheduleConfig(
        mtp_weights=torch.tensor(plan.mtp_weights, device=device),
        prefix_weight=torch.tensor(plan.prefix_weight, device=device),
        ws_short=plan.ws_short, ws_long=plan.ws_long, train_max_seq_len=plan.max_seq_len)


def _build(device, wrap=None):
    from track_1_short.model.gpt import GPT, GPTConfig
    # 4 keys per model (the self-checks reuse the grad-mode graph), and this file builds two models.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny()).to(device)
    model.resolve_attention_backend(device)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    forward_model = wrap(compiled) if wrap else compiled
    runner = StepGraphs(forward_model, _Optimizer(model), step_keys(SCHEDULE), model.ngram_table,
                        model.value_embeds, max(k.tokens for k in step_keys(SCHEDULE)),
                        **CADENCE, config=StepGraphsConfig(), backend=CudaGraphBackend(),
                        device=device)
    return model, forward_model, runner


def _advance_yarn(model, step: int, prev_stage: int) -> int:
    """As train.warmup_and_capture: YaRN follows ws_long at (or on jumping into) a new stage."""
    plan = SCHEDULE.plan(step)
    if plan.stage_index != prev_stage:
        model.apply_window_change(SCHEDULE.cfg.stages[prev_stage].ws_long, plan.ws_long)
    return plan.stage_index


def _slots(model, inputs):
    """ngram_slots of `inputs` (the row cache filled from a zero table, as at init)."""
    return NgramStore(model.ngram_table, cycle=1, micro_steps=1).slots_for(inputs)


def _run_step(model, runner, step: int, device):
    batch = _batch(step, device)
    slots = _slots(model, batch.inputs)
    cfg = _cfg(step, device)
    loss = runner.forward(step, batch, slots, cfg).item()
    runner.backward()
    return batch, slots, cfg, loss


def _eager_reference(model, batch, slots, cfg):
    """Uncompiled model, autograd, private sink and value-embed buffer (no shared side effects)."""
    sink = torch.zeros_like(model.ngram_table.grad_sink(batch.inputs.numel()), requires_grad=True)
    scratch = torch.zeros_like(model.value_embeds.grad_accum)
    loss = training_loss(model, batch.inputs, batch.targets, batch.cum_seqlens, slots, cfg, sink,
                         scratch)
    params = list(model.parameters())
    grads = loss_grads(loss, params + [sink])
    return loss.item(), dict(zip(params, grads[:-1])), grads[-1]


def _rel_err(a, b, floor: float = 0.0) -> float:
    """||a - b|| / max(||b||, floor). The floor keeps a gradient that is zero up to rounding (at
    init: x0/resid/skip lambdas behind zero-initialised projections, |g| ~ 1e-7) from turning float
    noise into a 'relative error' of order 1 (seen on the H200, 2026-11-29: graph == compiled
    bit for bit, both 1e-7 away from the uncompiled reference)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(max(floor, 1e-12))).item()


def _compiled_reference(forward_model, model, batch, slots, cfg):
    """The same compiled model launched eagerly (what --graphs off runs): the graph must match it."""
    sink = torch.zeros_like(model.ngram_table.grad_sink(batch.inputs.numel()), requires_grad=True)
    scratch = torch.zeros_like(model.value_embeds.grad_accum)
    loss = training_loss(forward_model, batch.inputs, batch.targets, batch.cum_seqlens, slots, cfg,
                         sink, scratch)
    params = list(model.parameters())
    grads = loss_grads(loss, params + [sink])
    return loss.item(), dict(zip(params, grads[:-1])), grads[-1]


@pytest.fixture(scope="module")
def sealed():
    device = torch.device("cuda")
    model, forward_model, runner = _build(device)
    parity = []
    stage = 0
    for step in warmup_visit_plan(SCHEDULE):
        stage = _advance_yarn(model, step, stage)
        batch, slots, cfg, loss = _run_step(model, runner, step, device)
        cs = runner.captured[runner.step_keys[step]]
        graph_grads = {p: g.clone() for p, g in cs.grads}
        graph_ngram = cs.ngram_grad.clone()
        ref_loss, ref_grads, ref_ngram = _eager_reference(model, batch, slots, cfg)
        _, cmp_grads, cmp_ngram = _compiled_reference(forward_model, model, batch, slots, cfg)
        floor = 1e-6 * torch.stack([g.float().norm() for g in ref_grads.values() if g is not None]).norm()
        errors = {}
        for name, p in model.named_parameters():
            if p in graph_grads:  # vs the compiled step (the bar) and vs uncompiled eager
                errors[name] = _rel_err(graph_grads[p], cmp_grads[p], floor)
                errors[name + " (uncompiled)"] = _rel_err(graph_grads[p], ref_grads[p], floor)
        errors["ngram_sink"] = _rel_err(graph_ngram, cmp_ngram)
        errors["ngram_sink (uncompiled)"] = _rel_err(graph_ngram, ref_ngram)
        parity.append((step, loss, ref_loss, errors))
    runner.seal()
    return model, runner, parity


def test_replay_matches_eager_for_every_key(sealed):
    model, runner, parity = sealed
    assert len(runner.captured) == 4
    for step, loss, ref_loss, errors in parity:
        assert loss == pytest.approx(ref_loss, rel=LOSS_REL_TOL), f"step {step}"
        worst = max(errors, key=errors.get)
        assert errors[worst] <= GRAD_REL_TOL, f"step {step}: {worst} rel err {errors[worst]}"
    for row in runner.capture_report():
        assert row["self_checks"] == 1 and row["replay_ms"] > 0
        assert row["pool_mib_added"] is not None


def test_timed_replays_after_seal(sealed):
    model, runner, _ = sealed
    model.reset_yarn()  # the post-warmup reset: scales back to stage A's (in place)
    for step in (2, 3):
        _run_step(model, runner, step, torch.device("cuda"))
    assert model.qk_bank.grad is next(g for p, g in runner.captured[runner.step_keys[3]].grads
                                      if p is model.qk_bank)


def test_unplanned_shape_after_seal_fails(sealed):
    model, runner, _ = sealed
    device = torch.device("cuda")
    batch = _batch(2, device)
    short = Batch(batch.inputs[:256], batch.targets[:256], batch.cum_seqlens.clamp(max=256))
    with pytest.raises(StepGraphError, match=r"step 2: live key .*tokens=256"):
        runner.forward(2, short, _slots(model, short.inputs), _cfg(2, device))


def test_rebound_parameter_fails_census(sealed):
    model, runner, _ = sealed
    before = take_census(model, runner)
    old = model.vo_bank.data
    model.vo_bank.data = old.clone()
    try:
        with pytest.raises(CensusError, match=r"changed param:vo_bank"):
            compare(before, take_census(model, runner))
    finally:
        model.vo_bank.data = old


def test_baked_value_fails_self_check():
    device = torch.device("cuda")
    model, wrapper, runner = _build(device, wrap=_ScaledLoss)
    _run_step(model, runner, 0, device)  # capture with scale 1.0 baked into the multiply
    wrapper.scale = 2.0
    with pytest.raises(StepGraphError, match=r"step 1: step graph .* replay loss .* != eager"):
        _run_step(model, runner, 1, device)


def test_varlen_attention_self_check_agrees_with_ground_truth():
    """DESIGN section 4 records varlen_attn (FA2) capturing without error under thread_local mode
    and replaying wrong results on torch 2.11. Whatever this GPU does with it, the warmup self-check
    must tell the truth: it raises exactly when the replay (loss or any gradient) differs from the
    uncompiled model run eagerly on the same buffers. Measured on the H200 (2026-11-30) with this
    tiny uncompiled model: the replay was right and the self-check passed; the earlier failure was
    not reproduced at this size."""
    from track_1_short.model.gpt import GPT, GPTConfig
    from track_1_short.trainer.build import BF16_PARAMS

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(attention_backend="varlen")).to(device)
    for name, p in model.named_parameters():
        if name in BF16_PARAMS:
            p.data = p.data.to(torch.bfloat16)  # FA2 needs bf16 activations, as in the trainer
    assert model.resolve_attention_backend(device) == "varlen"
    runner = StepGraphs(model, _Optimizer(model), step_keys(SCHEDULE), model.ngram_table,
                        model.value_embeds, max(k.tokens for k in step_keys(SCHEDULE)),
                        **CADENCE, config=StepGraphsConfig(), backend=CudaGraphBackend(),
                        device=device)
    _run_step(model, runner, 0, device)  # capture
    try:
        _run_step(model, runner, 1, device)  # replay + self-check of the same key
        verdict = None
    except CaptureError:
        raise
    except StepGraphError as e:
        verdict = str(e)
    # Ground truth on the buffers the self-check used (step 1's batch is in the static inputs).
    cs = runner.captured[runner.step_keys[1]]
    s = cs.static
    cs.forward.replay()
    cs.backward.replay()
    graph_loss, graph_grads = cs.loss.item(), {p: g.clone() for p, g in cs.grads}
    ref_loss, ref_grads, _ = _eager_reference(model, Batch(s.inputs, s.targets, s.cum_seqlens),
                                              s.ngram_slots, cs.cfg)
    floor = 1e-6 * torch.stack([g.float().norm() for g in ref_grads.values() if g is not None]).norm()
    errors = {name: _rel_err(graph_grads[p], ref_grads[p], floor)
              for name, p in model.named_parameters() if p in graph_grads}
    worst = max(errors, key=errors.get)
    replay_right = (abs(graph_loss - ref_loss) <= max(1e-3, 5e-4 * abs(ref_loss))
                    and errors[worst] <= GRAD_REL_TOL)
    print(f"varlen replay: loss {graph_loss} vs eager {ref_loss}, worst gradient {worst} "
          f"{errors[worst]:.3g}; self-check verdict: {verdict or 'passed'}")
    assert (verdict is None) == replay_right, (verdict, graph_loss, ref_loss, worst, errors[worst])


class _HostSync(nn.Module):
    yarn = yarn_paired_head = yarn_wide = SimpleNamespace(attn_scale=0.1)

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, device="cuda"))

    def forward(self, inputs, targets, cum_seqlens, ngram_slots, cfg, *, ngram_sink,
                value_embed_grad, embed_grad=None):
        x = (self.weight.sum() + ngram_sink.sum()).expand(inputs.numel())
        if x[0].item() > 1e30:  # host sync: fine eagerly, forbidden inside a capture
            x = x * 2
        return x


def test_host_sync_in_capture_names_the_key(request):
    """In a child process: a failed capture leaves the device's generator in capture state, so a
    later torch.randn on the device raises (seen on the H200, 2026-12-01)."""
    if rerun_in_child(request):
        return
    device = torch.device("cuda")
    from track_1_short.model.gpt import GPT, GPTConfig
    model = GPT(GPTConfig.tiny()).to(device)
    sync_model = _HostSync()
    opt = SimpleNamespace(param_cfgs={sync_model.weight: SimpleNamespace(optim="adam")})
    keys = step_keys(SCHEDULE)
    runner = StepGraphs(sync_model, opt, keys, model.ngram_table, model.value_embeds, 1024,
                        **CADENCE, config=StepGraphsConfig(warm_iterations=1),
                        backend=CudaGraphBackend(), device=device)
    batch = _batch(0, device)
    with pytest.raises(CaptureError, match=r"forward of step graph StepGraphKey\(tokens=512"):
        runner.forward(0, batch, _slots(model, batch.inputs), _cfg(0, device))
