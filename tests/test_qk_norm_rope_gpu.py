"""The q/k rms-norm + RoPE kernel (track_1_short/kernels/qk_norm_rope.py) on the H200 at the
stage-C shapes of one micro-step (T = 49,152 tokens, 6 heads of 128, bfloat16), unpaired and
paired.

Scope: values and the gradient of qk against the model's torch path computed in float32 from the
same bfloat16 input (within bfloat16 rounding); the forward and backward captured in one CUDA
graph and replayed equal to eager calls; no host sync in a call
(torch.cuda.set_sync_debug_mode("error")). The time of the kernel pair and of the torch path under
torch.compile, each forward + backward captured and replayed (CUDA events, median of 20), is
printed: a measurement, not asserted (bench/step.py --set train.qk_norm_rope=triton is the
benchmark).
Hardware: one CUDA GPU with ~8 GB free. Run: `PYTHONPATH=. python -m pytest -m gpu -s
tests/test_qk_norm_rope_gpu.py`.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

pytest.importorskip("triton")

from bench.common import time_steps  # noqa: E402
from track_1_short.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from track_1_short.model.gpt import norm_rotate  # noqa: E402
from track_1_short.model.yarn import Yarn  # noqa: E402

T, H, D = 49_152, 6, 128


def _fused(qk, yarn, paired):
    return qk_norm_rope(qk, *yarn.head_tables(), paired)


def _fwd_bwd(fn, qk, g, yarn, paired):
    x = qk.detach().requires_grad_(True)
    q, k = fn(x, yarn, paired)
    torch.autograd.backward((q, k), g)
    return q.detach(), k.detach(), x.grad


@pytest.mark.parametrize("paired", [False, True])
def test_stage_c_values_gradient_capture_and_no_sync(paired):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    yarn = Yarn(D, 2 * T, paired=paired).to(dev)
    yarn.extend_window(384, 1408)
    qk = torch.randn(T, 2, H, D, device=dev, dtype=torch.bfloat16)
    shape = (2 * T, H // 2, D) if paired else (T, H, D)
    g = tuple(torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(2))
    ref = _fwd_bwd(norm_rotate, qk.float(), tuple(x.float() for x in g), yarn, paired)
    got = _fwd_bwd(_fused, qk, g, yarn, paired)
    for r, x in zip(ref, got):
        assert x.dtype == torch.bfloat16
        assert torch.allclose(x.float(), r, rtol=2e-2, atol=2e-2), (x.float() - r).abs().max()

    torch.cuda.set_sync_debug_mode("error")
    try:
        _fwd_bwd(_fused, qk, g, yarn, paired)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    static = qk.clone()
    graph, outs = _captured(_fused, static, g, yarn, paired)
    static.copy_(qk * 2)
    graph.replay()
    eager = _fwd_bwd(_fused, qk * 2, g, yarn, paired)
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)

    # replays of captured graphs: GPU time without the host's per-call cost (eager calls of
    # ~1 ms each were host-bound in the eighteenth lease and timed the host, not the kernels)
    torch_graph, _ = _captured(torch.compile(norm_rotate), qk.clone(), g, yarn, paired)
    fused_ms = time_steps(lambda i: graph.replay(), 20, dev)
    torch_ms = time_steps(lambda i: torch_graph.replay(), 20, dev)
    print(f"\nqk_norm_rope paired={paired} at C, forward + backward replayed: kernel pair "
          f"{fused_ms}, compiled torch path {torch_ms}")


def _captured(fn, static, g, yarn, paired):
    """fn's forward + backward over `static` captured in one CUDA graph (warmed on a side
    stream first: compile, autotune, first launches): (graph, its q, k and qk-gradient)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _fwd_bwd(fn, static, g, yarn, paired)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _fwd_bwd(fn, static, g, yarn, paired)
    return graph, outs
