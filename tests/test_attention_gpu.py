"""Attention backends on a real GPU against the CPU reference: FlexAttention compiled (the graph
path's backend, forward and backward), FA2 varlen eager and FA3 where importable, each on bf16
inputs on the GPU, against `reference_attention` in float64 on the CPU on the same (bf16-rounded)
values. Cases cover one document, several documents (document masking, including 1-token
documents), windows from 0 (self only) to larger than the document, and causality (changing
future keys and values leaves earlier outputs unchanged).

Scope: tests/test_attention.py checks flex against the reference on the CPU, forward only and
eager (no CPU flex backward); this file checks the CUDA kernels.
Hardware: one CUDA GPU (H200 for the project's evidence); ~30 s, mostly flex compiles (one per
window: the window is a Python int the block mask closes over).
Run: `.venv/bin/python -m pytest -m gpu tests/test_attention_gpu.py -q`.

Legend: T tokens, H heads, D head_dim.
"""

import importlib.util

import pytest
import torch

from tests.cuda_capture import warm_and_capture
from tests.test_attention import _cu
from track_1_short.model.attention import _fa3_available, attention, reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, D = 2, 128  # the speedrun's head_dim
SCALE = D ** -0.5
# bf16 inputs, bf16 output (relative rounding 2^-9) and bf16 probabilities inside the kernels;
# outputs are convex combinations of N(0, 1) values (|out| <~ 3).
ATOL = RTOL = 2e-2
CASES = [([256], 300), ([100, 156], 64), ([5, 130, 1, 120], 17), ([300, 212], 128), ([512], 0)]


def _inputs(lengths, seed=0):
    """q, k, v bf16 [T, H, D] on the GPU with float64 CPU copies of the same values, cu_seqlens."""
    t = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(t, H, D, generator=g).bfloat16() for _ in range(3)]
    return ([x.cuda() for x in qkv], [x.double() for x in qkv], _cu(lengths, capacity=8))


def _compiled_flex():
    # one compile per (T, window, grad mode): this file needs 7, the default limit is 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(attention, fullgraph=True, dynamic=False)


def _varlen_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("torch.nn.attention.varlen") is not None


@pytest.mark.parametrize("lengths,window", CASES)
def test_flex_compiled_matches_cpu_reference(lengths, window):
    (q, k, v), (q64, k64, v64), cu = _inputs(lengths)
    out = _compiled_flex()(q, k, v, cu.cuda(), max(lengths), window, SCALE, "flex")
    ref = reference_attention(q64, k64, v64, cu, window, SCALE)
    torch.testing.assert_close(out.cpu().double(), ref, atol=ATOL, rtol=RTOL)


def test_flex_compiled_backward_matches_cpu_reference():
    """The training path differentiates through flex: q, k, v gradients against float64 autograd
    of the reference (several documents, a window inside the longest one)."""
    lengths, window = [5, 130, 1, 120], 64
    (q, k, v), (q64, k64, v64), cu = _inputs(lengths, seed=1)
    probe = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = _compiled_flex()(q, k, v, cu.cuda(), max(lengths), window, SCALE, "flex")
    grads = torch.autograd.grad(out, leaves, probe.cuda())
    leaves64 = [x.requires_grad_() for x in (q64, k64, v64)]
    ref = reference_attention(*leaves64, cu, window, SCALE)
    ref_grads = torch.autograd.grad(ref, leaves64, probe.double())
    for name, g, r in zip("qkv", grads, ref_grads):
        # gradients sum over up to `window` keys: scale the tolerance by their size
        torch.testing.assert_close(g.cpu().double(), r, atol=ATOL * r.abs().max().item(), rtol=RTOL,
                                   msg=lambda m: f"grad {name}: {m}")


def test_flex_compiled_is_causal_and_document_masked():
    (q, k, v), _, cu = _inputs([200, 312], seed=3)
    run = _compiled_flex()
    base = run(q, k, v, cu.cuda(), 312, 1000, SCALE, "flex")
    k2, v2 = k.clone(), v.clone()
    k2[150:200], v2[150:200] = 3.0, 5.0  # future keys of document 0's first 150 queries
    moved = run(q, k2, v2, cu.cuda(), 312, 1000, SCALE, "flex")
    torch.testing.assert_close(moved[:150], base[:150], atol=1e-3, rtol=0)
    torch.testing.assert_close(moved[200:], base[200:], atol=1e-3, rtol=0)  # document 1 cannot see them
    assert (moved[150:200] - base[150:200]).abs().max() > 0.1  # and the change is visible where allowed


@pytest.mark.skipif(not _varlen_available(), reason="torch.nn.attention.varlen not in this torch")
@pytest.mark.parametrize("lengths,window", CASES)
def test_varlen_matches_cpu_reference(lengths, window):
    (q, k, v), (q64, k64, v64), cu = _inputs(lengths)
    out = attention(q, k, v, cu.cuda(), max(lengths), window, SCALE, "varlen")
    ref = reference_attention(q64, k64, v64, cu, window, SCALE)
    torch.testing.assert_close(out.cpu().double(), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("lengths,window", CASES[1:3])
def test_fa3_matches_cpu_reference(lengths, window):
    nn_attention = torch.nn.attention
    if not _fa3_available():  # activates FA3 globally when it is importable
        pytest.skip("FA3 is not importable here")
    try:
        (q, k, v), (q64, k64, v64), cu = _inputs(lengths)
        out = attention(q, k, v, cu.cuda(), max(lengths), window, SCALE, "fa3")
        ref = reference_attention(q64, k64, v64, cu, window, SCALE)
        torch.testing.assert_close(out.cpu().double(), ref, atol=ATOL, rtol=RTOL)
    finally:  # later tests expect the default flash implementation
        restore = getattr(nn_attention, "restore_flash_attention_impl", None)
        if restore is not None:
            restore()


def _fa4_or_skip():
    from track_1_short.model.attention_fa4 import fa4_unavailable_reason

    why = fa4_unavailable_reason(torch.device("cuda"))
    if why is not None:
        pytest.skip(f"fa4: {why}")


@pytest.mark.parametrize("lengths,window", CASES)
def test_fa4_matches_cpu_reference_forward_and_backward(lengths, window):
    """FlashAttention 4 (model/attention_fa4.py) eager: output and q, k, v gradients against
    float64 autograd of the reference."""
    _fa4_or_skip()
    (q, k, v), (q64, k64, v64), cu = _inputs(lengths, seed=4)
    probe = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = attention(*leaves, cu.cuda(), max(lengths), window, SCALE, "fa4")
    grads = torch.autograd.grad(out, leaves, probe.cuda())
    leaves64 = [x.requires_grad_() for x in (q64, k64, v64)]
    ref = reference_attention(*leaves64, cu, window, SCALE)
    ref_grads = torch.autograd.grad(ref, leaves64, probe.double())
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), atol=ATOL, rtol=RTOL)
    # each gradient's tolerance scales with its size; at window 0 (self only) the q and k
    # gradients are exactly 0 and the kernel's are rounding residues of dP - D (~1e-6 on the
    # H200, 2026-12-01): the floor is a thousandth of the largest gradient (dv ~ |probe|)
    floor = 1e-3 * max(r.abs().max().item() for r in ref_grads)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.cpu().double(), r, atol=ATOL * max(r.abs().max().item(), floor),
                                   rtol=RTOL, msg=lambda m: f"grad {name}: {m}")


def test_fa4_compiled_and_captured_replays_equal_eager():
    """The path the step graphs take: compiled (fullgraph) forward + backward captured in one
    CUDA graph; a replay on new values in the same buffers equals the eager op on them."""
    _fa4_or_skip()
    lengths, window = [5, 130, 1, 120], 64
    (q, k, v), _, cu = _inputs(lengths, seed=6)
    cu = cu.cuda()
    run = torch.compile(attention, fullgraph=True, dynamic=False)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    probe = torch.randn_like(q)

    def step():
        out = run(*leaves, cu, max(lengths), window, SCALE, "fa4")
        return (out, *torch.autograd.grad(out, leaves, probe))

    graph, captured = warm_and_capture(step)  # compile, then the kernels' JIT: outside the capture
    g = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        for x in (*leaves, probe):
            x.copy_(torch.randn(x.shape, generator=g, device="cuda").bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    eager_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    out = attention(*eager_leaves, cu, max(lengths), window, SCALE, "fa4")
    eager = (out, *torch.autograd.grad(out, eager_leaves, probe))
    for name, c, e in zip(("out", "dq", "dk", "dv"), captured, eager):
        torch.testing.assert_close(c, e, atol=1e-2, rtol=1e-2, msg=lambda m: f"{name}: {m}")
