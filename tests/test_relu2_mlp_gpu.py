"""The fused ReLU^2 MLP (kernels/relu2_mlp.py, quack-kernels) on the GPU against the reference
(PlainMatmuls.relu2_mlp, float32 on the same bf16 values): output and the three gradients at one
layer's speedrun shapes (D 768, F 3072), eager and compiled + captured in a CUDA graph (a replay
on new values in the same buffers equals the eager op on them).

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


def _strategy():
    from track_1_short.kernels.relu2_mlp import QUACK_MLP_LABEL, quack_relu2_mlp, quack_unavailable_reason

    reason = quack_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"quack MLP: {reason}")
    matmuls = PlainMatmuls()
    matmuls.use_fused_mlp(quack_relu2_mlp, QUACK_MLP_LABEL)
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


def test_quack_mlp_compiled_and_captured_replays_equal_eager():
    fused = _strategy()
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
