"""The fused ReLU^2 MLP (kernels/relu2_mlp.py, quack-kernels) on the GPU against the reference
(PlainMatmuls.relu2_mlp, float32 on the same bf16 values): output and the three gradients at one
layer's speedrun shapes (D 768, F 3072), eager and compiled + captured in a CUDA graph (a replay
on new values in the same buffers equals the eager op on them). The fp8 up projection
(quack_relu2_mlp_fp8_up) against its reference, the unfused fp8 "mlp_up" site with the bf16
backward (Fp8Matmuls.relu2_mlp, cuBLAS _scaled_mm), eager and captured.

Hardware: one CUDA GPU of compute capability 9.x / 10.x with quack-kernels importable (on the
H200 hosts: scripts/gpu/fa4_wheels.sh here, fa4_install.sh there, `source .fa4_site/ENV`);
skipped, with the reason, otherwise. ~1 min (quack's JIT and autotuning at the first call).
Run: `python3 -m pytest -m gpu tests/test_relu2_mlp_gpu.py -q`.
"""

import pytest
import torch

from tests.cuda_capture import warm_and_capture
from track_1_short.model.fp8 import PlainMatmuls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
T, D, F = 4096, 768, 3072


def _strategy(fp8_up: bool = False):
    """The fused MLP's strategy: plain, or with fp8_up Fp8Matmuls(lm_head, mlp_up; bf16 MLP
    backward) holding the fp8-up quack MLP."""
    from track_1_short.kernels import relu2_mlp

    reason = relu2_mlp.quack_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"quack MLP: {reason}")
    if not fp8_up:
        matmuls = PlainMatmuls()
        matmuls.use_fused_mlp(relu2_mlp.quack_relu2_mlp, relu2_mlp.QUACK_MLP_LABEL)
        return matmuls
    matmuls = _fp8_up_site()
    matmuls.use_fused_mlp(relu2_mlp.quack_relu2_mlp_fp8_up, relu2_mlp.QUACK_MLP_FP8_UP_LABEL,
                          fp8_sites=("mlp_up",))
    return matmuls


def _fp8_up_site():
    """The unfused reference of the fp8 up projection: Fp8Matmuls' "mlp_up" site, bf16 backward."""
    from track_1_short.model.fp8 import Fp8Matmuls
    from track_1_short.model.fp8_config import Fp8Config

    matmuls = Fp8Matmuls(Fp8Config(enabled=True, sites=("lm_head", "mlp_up"), mlp_backward="bf16"),
                         num_layers=1).cuda()
    if not matmuls.resolve(torch.device("cuda")):
        pytest.skip("fp8 matmuls cannot run on this GPU")
    return matmuls


def _operands(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    w_up, w_down = (torch.empty(F, D).uniform_(-0.03, 0.03, generator=g) for _ in range(2))
    dy = torch.randn(T, D, generator=g)
    return [t.bfloat16().cuda() for t in (x, w_up, w_down, dy)]


def _run(fn, x, w_up, w_down, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_up, w_down)]
    y = fn(*leaves, layer=0)
    return (y, *torch.autograd.grad(y, leaves, dy))


def _close(got, ref, name):
    scale = ref.abs().max().item()
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2 * scale, rtol=2e-2,
                               msg=lambda m: f"{name}: {m}")


def test_quack_mlp_matches_the_reference_forward_and_backward():
    fused = _strategy()
    x, w_up, w_down, dy = _operands(0)
    got = _run(fused.relu2_mlp, x, w_up, w_down, dy)
    ref = _run(PlainMatmuls().relu2_mlp, *(t.float() for t in (x, w_up, w_down, dy)))
    for name, g, r in zip(("y", "dx", "dw_up", "dw_down"), got, ref):
        _close(g, r, name)


def test_quack_mlp_fp8_up_matches_the_unfused_fp8_site():
    """The same amax scales and e4m3 operands on both sides; quack squares the float32
    accumulator where the reference squares its bf16 rounding, hence the bf16-level tolerance."""
    fused = _strategy(fp8_up=True)
    x, w_up, w_down, dy = _operands(3)
    got = _run(fused.relu2_mlp, x, w_up, w_down, dy)
    ref = _run(_fp8_up_site().relu2_mlp, x, w_up, w_down, dy)
    for name, g, r in zip(("y", "dx", "dw_up", "dw_down"), got, ref):
        _close(g, r, name)


@pytest.mark.parametrize("fp8_up", [False, True])
def test_quack_mlp_compiled_and_captured_replays_equal_eager(fp8_up):
    fused = _strategy(fp8_up)
    x, w_up, w_down, dy = _operands(1)
    leaves = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
    run = torch.compile(fused.relu2_mlp, fullgraph=True, dynamic=False)

    def step():
        y = run(*leaves, layer=0)
        return (y, *torch.autograd.grad(y, leaves, dy))

    graph, captured = warm_and_capture(step)  # compile, JIT and autotune outside the capture
    fresh = _operands(2)
    with torch.no_grad():
        for dst, src in zip((*leaves, dy), fresh):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = _run(fused.relu2_mlp, *(t.detach() for t in leaves), dy)
    for name, c, e in zip(("y", "dx", "dw_up", "dw_down"), captured, eager):
        _close(c, e, name)
