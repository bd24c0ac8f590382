"""The fused lm-head loss with an fp8 lm head (track_1_short/kernels/softcap_ce_fp8.py) on a real
GPU.

Scope: what the interpreter cases (tests/softcap_ce_cases.py: the op against model/fp8.py's slow
references, and its fullgraph trace) cannot show: cuBLASLt's fp8 GEMMs and the compiled kernel at
the speedrun's shapes (V = 50,304, D = 768; keys A and C as tests/test_softcap_ce_gpu.py) with the
lm head's static scales, against the torch path that --fp8 ran before it (model/fp8.fp8_matmul,
then model/loss.py's softcap and training_loss in bf16 autograd); torch.compile(fullgraph=True)
and CUDA-graph capture replayed on new inputs equal to eager; no host sync in forward + backward.
Each test prints its measured errors and, for orientation, the fused fp8 and bf16 heads' forward +
backward time (CUDA events; the step-level measurement is scripts/gpu/fp8_step.sh).
Hardware: one CUDA GPU with fp8 tensor cores (capability >= 8.9) and >= 60 GB (H200); ~30 s.
Run: `PYTHONPATH=. .venv/bin/python -m pytest -m gpu tests/test_softcap_ce_fp8_gpu.py -q -s`.

Legend: T tokens, D model dim, V vocab.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

triton = pytest.importorskip("triton")

from tests.cuda_capture import warm_and_capture  # noqa: E402
from tests.test_softcap_ce_gpu import KEYS, _inputs, rel_err  # noqa: E402
from track_1_short.kernels.softcap_ce import linear_softcap_ce  # noqa: E402
from track_1_short.kernels.softcap_ce_fp8 import linear_softcap_ce_fp8  # noqa: E402
from track_1_short.model.fp8 import (LM_HEAD_GRAD_SCALE, LM_HEAD_W_SCALE, LM_HEAD_X_SCALE,  # noqa: E402
                                     fp8_matmul, fp8_unavailable_reason)
from track_1_short.model.loss import softcap, training_loss  # noqa: E402


@pytest.fixture(autouse=True)
def _fp8_or_skip():
    why = fp8_unavailable_reason(torch.device("cuda"))
    if why is not None:
        pytest.skip(f"fp8: {why}")


def _scales():
    return {name: torch.tensor(value, device="cuda") for name, value in
            (("x_s", LM_HEAD_X_SCALE), ("w_s", LM_HEAD_W_SCALE), ("grad_s", LM_HEAD_GRAD_SCALE))}


def _fused(x, w, targets, mtp, pw, prefix, scales):
    return linear_softcap_ce_fp8(x, w, targets, mtp, pw, prefix, **scales)


def _torch_fp8(x, w, targets, mtp, pw, prefix, scales):
    z = fp8_matmul(x, w, scales["x_s"], scales["w_s"], scales["grad_s"])  # [T, V] bf16
    return training_loss(softcap(z), targets, mtp, pw, prefix)


def _grads(fn, x, w, *rest):
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(xl, wl, *rest)
    dx, dw = torch.autograd.grad(loss.sum(), (xl, wl))
    return loss.detach(), dx, dw


def _ms(fn, *args, reps: int = 5) -> float:
    for _ in range(2):
        _grads(fn, *args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        _grads(fn, *args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.parametrize("key", sorted(KEYS))
def test_equals_the_torch_fp8_path_at_speedrun_shapes(key):
    """The same fp8 forward GEMM: the loss equal within float32 rounding; the gradients from the
    same e5m2 grid (the torch path's bf16 softcap backward against the kernel's float32 one can
    move an element across a rounding boundary of the 2-bit mantissa)."""
    args = (*_inputs(key, seed=1), _scales())
    fused, ref = _grads(_fused, *args), _grads(_torch_fp8, *args)
    errs = {"loss_max": float((fused[0] - ref[0]).abs().max() / ref[0].abs().max()),
            "dx_rel": rel_err(fused[1], ref[1].float()), "dw_rel": rel_err(fused[2], ref[2].float())}
    bf16 = _grads(linear_softcap_ce, *args[:-1])
    errs["dx_rel_vs_bf16_head"] = rel_err(fused[1], bf16[1].float())
    times = {"fp8 fused": _ms(_fused, *args), "bf16 fused": _ms(linear_softcap_ce, *args[:-1])}
    print(f"\nkey {key}: " + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()) + "; forward + backward "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()))
    assert errs["loss_max"] < 1e-3  # fast accumulation on both sides; bf16 logits on both
    assert max(errs["dx_rel"], errs["dw_rel"]) < 3e-2


def test_compiled_and_captured_replay_equals_eager():
    static = (*_inputs("A", seed=3), _scales())
    compiled = torch.compile(_fused, fullgraph=True, dynamic=False)
    eager = _grads(_fused, *static)
    comp = _grads(compiled, *static)
    torch.testing.assert_close(comp[0], eager[0], rtol=1e-6, atol=1e-5)
    assert rel_err(comp[1], eager[1].float()) < 1e-2 and rel_err(comp[2], eager[2].float()) < 1e-2
    x, w = static[0].requires_grad_(), static[1].requires_grad_()

    def step():
        loss = compiled(x, w, *static[2:])
        return (loss, *torch.autograd.grad(loss.sum(), (x, w)))

    graph, (loss, dx, dw) = warm_and_capture(step)
    fresh = _inputs("A", seed=5)
    with torch.no_grad():
        for buf, new in zip((x, static[2], static[5]), (fresh[0], fresh[2], fresh[5])):
            buf.copy_(new)
    graph.replay()
    ref = _grads(_fused, fresh[0], w.detach(), fresh[2], static[3], static[4], fresh[5], static[6])
    torch.testing.assert_close(loss, ref[0], rtol=1e-6, atol=1e-5)
    assert rel_err(dx, ref[1].float()) < 1e-2 and rel_err(dw, ref[2].float()) < 1e-2


def test_forward_and_backward_do_not_sync_the_host():
    args = (*_inputs("A", seed=6), _scales())
    x, w = args[0].requires_grad_(), args[1].requires_grad_()
    torch.autograd.grad(_fused(x, w, *args[2:]).sum(), (x, w))  # the kernel's JIT outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.grad(_fused(x, w, *args[2:]).sum(), (x, w))
    finally:
        torch.cuda.set_sync_debug_mode("default")
