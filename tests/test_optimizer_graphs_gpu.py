"""OptimizerGraphs on one CUDA GPU (real torch.cuda.graph captures): replay equals eager, no host
sync inside a replay, and a value baked into a captured kernel is caught by the self-check.

Scope: tests/test_anvil_math.Tiny at small CUDA shapes (vocab 96, dim 64), the update functions
compiled with inductor (the CUDA default) in both the captured optimizer and its eager twin.
Replay vs eager over 10 steps (lr and momentum changing every step; ANVIL-only, Adam tied, the
untie after step 3, Adam untied; sealed after step 7), for both gradient-input modes, fp32 with
fp32 Polar Express and TF32 off (tight) and bf16 with bf16 Polar Express (the trainer's setting);
parameters compared relative to their total update (as tests/test_anvil_gpu.py, with a floor),
state tensors relative to their norm; the in-run self-checks pass and the capture report is
filled. Then RING_SLOTS replayed steps under torch.cuda.set_sync_debug_mode("error") (after a synchronize, so
the StepValues ring never waits). Then a Python float read by run_step, changed after capture:
the replay keeps the captured value (what the CPU stand-in cannot show) and the second visit's
self-check names the tensor. Last, a host sync (.item()) inside run_step: caught by the warm
iterations' sync debug mode, or (sync_debug_warmup off) by the capture, as a CaptureError.
Hardware: 1 CUDA GPU (~1-2 min, mostly inductor compiles).
Run: `.venv/bin/python -m pytest -m gpu tests/test_optimizer_graphs_gpu.py -q`.
"""

import pytest
import torch

from tests.mp_utils import rerun_in_child
from tests.test_anvil_fused import _opt
from tests.test_anvil_gpu import _cuda_tiny
from tests.test_optimizer_graphs import PLANS, UNTIE_AFTER, Producer, run, step_once
from track_1_short.optim.step_values import RING_SLOTS
from track_1_short.perf.cuda_graphs.capture_support import CaptureError
from track_1_short.perf.cuda_graphs.optimizer_graphs import (
    Cadence, OptimizerGraphError, OptimizerGraphs, OptimizerGraphsConfig, make_optimizer_graphs)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _graphs(model, grad_inputs="stage", **anvil):
    opt = _opt(model, **anvil)  # compile=None: inductor on CUDA parameters
    graphs = make_optimizer_graphs(opt, OptimizerGraphsConfig(grad_inputs=grad_inputs),
                                   plans=PLANS[:16], untie_step=UNTIE_AFTER)
    assert isinstance(graphs, OptimizerGraphs) and opt.compiled
    return opt, graphs


@pytest.mark.parametrize("grad_inputs", ["stage", "adopt"])
@pytest.mark.parametrize("dtype, ortho, rtol", [(torch.float32, "float32", 1e-4),
                                                (torch.bfloat16, "auto", 2e-2)])
def test_replay_matches_eager_over_10_steps(grad_inputs, dtype, ortho, rtol, fp32_matmuls):
    torch._dynamo.reset()
    model, twin = _cuda_tiny(dtype), _cuda_tiny(dtype)
    start = {n: p.detach().float().clone() for n, p in twin.named_parameters()}
    eager = _opt(twin, ortho_dtype=ortho)
    opt, graphs = _graphs(model, grad_inputs, ortho_dtype=ortho)
    run(eager, Producer(twin, eager, seed=50, persistent=False), range(10))
    run(graphs, Producer(model, opt, seed=50, persistent=grad_inputs == "adopt"), range(10),
        seal_after=7)
    torch.cuda.synchronize()
    assert {str(c): g.checked for c, g in graphs.captured.items()} == {
        "anvil": True, "adam_tied": True, "adam_untied": True}
    report = graphs.capture_report()
    assert all(r["replay_ms"] > 0 and r["pool_mib_added"] is not None for r in report), report
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        # relative to the total update; a bf16 parameter whose update stays below its rounding
        # step (smear_gate: lr 8e-5) does not move at all, hence the floor
        moved = torch.maximum((p.float() - start[name]).norm(), 1e-6 * p.float().norm())
        err = ((q.float() - p.float()).norm() / moved.clamp_min(1e-12)).item()
        assert err < rtol, f"{name}: replay vs eager {err:.2e} of the update"
    for (role, t), (_, u) in zip(eager.named_state_tensors(), opt.named_state_tensors()):
        err = ((u.float() - t.float()).norm() / t.float().norm().clamp_min(1e-12)).item()
        assert err < rtol, f"{role}: replay vs eager {err:.2e}"


def test_replay_has_no_host_sync():
    torch._dynamo.reset()
    model = _cuda_tiny(torch.bfloat16)
    opt, graphs = _graphs(model)
    producer = Producer(model, opt, seed=51, persistent=False)
    run(graphs, producer, range(8), seal_after=7)
    replays = {c: s.replays for c, s in graphs.stats.items()}
    torch.cuda.synchronize()  # every StepValues ring slot free: write() does not wait either
    for step in range(8, 8 + RING_SLOTS):
        producer()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step_once(graphs, step)  # any synchronising call raises
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    after = {c: s.replays for c, s in graphs.stats.items()}
    assert sum(after.values()) - sum(replays.values()) == RING_SLOTS
    assert after[Cadence(True, False)] > replays[Cadence(True, False)]  # Adam steps replayed too
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_self_check_catches_a_value_baked_into_the_graph():
    torch._dynamo.reset()
    model = _cuda_tiny(torch.float32)
    opt, graphs = _graphs(model)
    run_step, opt.fault = opt.run_step, 0.0

    def faulty_run_step(step, adam_step):
        run_step(step, adam_step)
        # a Python float reaches the kernel as a launch argument: the capture bakes 0.0
        opt.banks[0].momentum.add_(opt.fault)

    opt.run_step = faulty_run_step
    producer = Producer(model, opt, seed=52, persistent=False)
    run(graphs, producer, range(2))  # anvil captured at step 0
    opt.fault = 1.0
    with pytest.raises(OptimizerGraphError, match=r"step 2: optimizer graph anvil: replayed "
                                                  r"optimizer\.banks\.qk_bank\.momentum differs"):
        run(graphs, producer, [2])


def _item_in_run_step(opt):
    run_step = opt.run_step

    def syncing_run_step(step, adam_step):
        run_step(step, adam_step)
        opt.step_values.values[0].item()  # a host sync

    opt.run_step = syncing_run_step


@pytest.mark.parametrize("sync_debug_warmup", [True, False])
def test_host_sync_in_run_step_is_named(sync_debug_warmup, request):
    """Caught by the warm iterations' sync debug mode, or else by the capture (CaptureError). In a
    child process: a failed capture leaves the device's generator unusable for later tests."""
    if rerun_in_child(request):
        return
    model = _cuda_tiny(torch.float32)
    opt = _opt(model, compile=False)
    graphs = make_optimizer_graphs(opt, OptimizerGraphsConfig(sync_debug_warmup=sync_debug_warmup))
    _item_in_run_step(opt)
    Producer(model, opt, seed=53, persistent=False)()
    if sync_debug_warmup:
        with pytest.raises(RuntimeError, match="synchronizing"):
            step_once(graphs, 0, lr=1.0)
    else:
        with pytest.raises(CaptureError, match=r"capture of the step of optimizer graph anvil failed"):
            step_once(graphs, 0, lr=1.0)
    torch.cuda.set_sync_debug_mode("default")
