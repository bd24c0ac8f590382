"""Polar Express's quack GEMMs (kernels/polar_gemms.py, optim.polar_gemms=quack) on the GPU, at
the speedrun's bank shapes on one rank (BANKS, bench/polar_express.bank_shapes: qk_bank [64, 256, 768]
wide, vo_bank [24, 768, 768] square, mlp_bank [24, 3072, 768] tall): in bf16 against the
float64 iteration, the quack path's error is at most 1.05x torch's bf16 path's, eagerly and
under torch.compile(fullgraph=True) (inductor); the compiled function captured in a CUDA graph,
replayed on new values in its input buffer, equals the same compiled function run outside the
graph; the compiled bank step (anvil_math.anvil_bank_step_) with quack's GEMMs stays as close to
the float64 update as with torch's.

Hardware: one CUDA GPU of compute capability 9.x / 10.x with quack-kernels importable (on the
H200 hosts: scripts/gpu/fa4_wheels.sh here, fa4_install.sh there, `source .fa4_site/ENV`);
skipped, with the reason, otherwise. ~1-2 min (quack's JIT and autotuning at the first call per
shape, inductor compiles). Run: `python3 -m pytest -m gpu tests/test_polar_gemms_gpu.py -q`.
"""

import pytest
import torch

from tests.cuda_capture import warm_and_capture
from track_1_short.optim import anvil_math
from track_1_short.optim.polar_express import POLAR_EXPRESS_COEFFS, TORCH_PE_GEMMS, polar_express

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BF16, F64 = torch.bfloat16, torch.float64
ERROR_RATIO = 1.05  # quack's bf16 error may exceed torch's bf16 error by at most this factor


# [M, R, C] per bank, one rank (tests/test_polar_gemms.py checks them against the model)
BANKS = {"qk_bank": (64, 256, 768), "vo_bank": (24, 768, 768), "mlp_bank": (24, 3072, 768)}


def _quack():
    from track_1_short.kernels import polar_gemms

    reason = polar_gemms.polar_express_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"quack Polar Express GEMMs: {reason}")
    return polar_gemms.QUACK_PE_GEMMS


def _g(shape, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=gen)  # [M, R, C] fp32


def _error(x, ref) -> float:
    """Worst relative Frobenius error over the batch's matrices."""
    diff = (x.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    return diff.max().item()


@pytest.mark.parametrize("name", list(BANKS))
@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_error_no_worse_than_torch(name, compiled):
    quack = _quack()
    g = _g(BANKS[name], seed=0)
    ref = polar_express(g.double(), F64)
    run = torch.compile(polar_express, fullgraph=True, dynamic=False) if compiled else polar_express
    got = run(g, BF16, POLAR_EXPRESS_COEFFS, quack)
    torch_error, quack_error = _error(polar_express(g, BF16), ref), _error(got, ref)
    assert got.dtype == BF16 and got.shape == g.shape and got.is_contiguous()
    assert quack_error <= ERROR_RATIO * torch_error, \
        f"{name}: quack's bf16 error {quack_error:.3e} > {ERROR_RATIO} x torch's {torch_error:.3e}"


@pytest.mark.parametrize("name", list(BANKS))
def test_compiled_and_captured_replay_equals_the_compiled_call(name):
    quack = _quack()
    shape = BANKS[name]
    g = _g(shape, seed=1)  # the graph's input buffer
    run = torch.compile(polar_express, fullgraph=True, dynamic=False)
    graph, captured = warm_and_capture(lambda: run(g, BF16, POLAR_EXPRESS_COEFFS, quack))
    g.copy_(_g(shape, seed=2))
    graph.replay()
    torch.cuda.synchronize()
    expected = run(g, BF16, POLAR_EXPRESS_COEFFS, quack)
    torch.testing.assert_close(captured, expected, rtol=0, atol=0,
                               msg=lambda m: f"{name}: replay != the compiled call: {m}")


def _bank_step(gemms, grad, target):
    """One compiled anvil_bank_step_ from zero state on copies of grad / target; the new target."""
    k, rows, cols = grad.shape
    target = target.clone()
    momentum = torch.zeros_like(target)
    second = torch.zeros((k, rows, 1) if rows >= cols else (k, 1, cols), device="cuda")
    lr_mul = torch.ones(k, 1, 1, device="cuda")
    scalars = torch.tensor([0.95, 0.02, 0.024], device="cuda")
    step = torch.compile(anvil_math.anvil_bank_step_, fullgraph=True, dynamic=False)
    step(grad, momentum, second, target, None, lr_mul, scalars, 0.9,
         F64 if gemms is None else BF16, POLAR_EXPRESS_COEFFS, gemms)
    return target


def test_compiled_bank_step_update_as_close_as_torch():
    """mlp_bank: the update (target after - before) with quack's GEMMs against the float64 step's,
    at most 1.05x the torch bf16 step's error."""
    quack = _quack()
    grad, target = _g(BANKS["mlp_bank"], seed=3).bfloat16(), 0.02 * _g(BANKS["mlp_bank"], seed=4)
    ref = _bank_step(None, grad.double(), target.double()) - target.double()  # float64 throughout
    errors = {label: _error(_bank_step(gemms, grad, target) - target, ref)
              for label, gemms in (("torch", TORCH_PE_GEMMS), ("quack", quack))}
    assert errors["quack"] <= ERROR_RATIO * errors["torch"], errors
