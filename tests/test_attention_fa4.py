"""The "fa4" attention backend's plumbing on the CPU (model/attention_fa4.py): its two custom ops
with a torch stand-in for flash-attn-4's interface (the reference attention, and its autograd
for the backward) give the reference's output and gradients eagerly and under
torch.compile(fullgraph=True); the arguments FA4 receives say causal, window (W, 0), one
cum_seqlens for queries and keys; without CUDA or the package the backend is refused by name.
The kernels themselves: tests/test_attention_gpu.py on the H200.

Hardware: CPU only, a few seconds. Run: `.venv/bin/python -m pytest tests/test_attention_fa4.py -q`.
"""

import importlib.util

import pytest
import torch

from tests.test_attention import _cu
from track_1_short.model import attention_fa4
from track_1_short.model.attention import attention, reference_attention, resolve_backend

SCALE = 0.12


class _StandIn:
    """flash_attn.cute.interface's two entry points, in torch (float64 on the CPU)."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _ref(q, k, v, cu, window, scale):
        return reference_attention(q, k, v, cu, window, scale)

    @staticmethod
    def _probs(q, k, cu, window, scale):
        """Softmax probabilities [H, T, T] of the reference's mask."""
        t = q.shape[0]
        doc = torch.searchsorted(cu, torch.arange(t, dtype=cu.dtype), right=True)
        delta = torch.arange(t)[:, None] - torch.arange(t)[None, :]
        allowed = (delta >= 0) & (delta <= window) & (doc[:, None] == doc[None, :])
        s = scale * torch.einsum("qhd,khd->hqk", q, k)
        return s.masked_fill(~allowed, float("-inf")).softmax(-1)

    def _flash_attn_fwd(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, window_size_left, window_size_right, return_lse):
        self.calls.append(dict(kind="fwd", same_cu=cu_seqlens_q is cu_seqlens_k, causal=causal,
                               window=(window_size_left, window_size_right), lse=return_lse,
                               max_seqlen=(max_seqlen_q, max_seqlen_k)))
        out = self._ref(q, k, v, cu_seqlens_q, window_size_left, softmax_scale)
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)  # [H, T]; unused here
        return out, lse, None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, scale, causal, softcap, *, window_size_left,
                        window_size_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        self.calls.append(dict(kind="bwd", same_cu=cu_seqlens_q is cu_seqlens_k, causal=causal,
                               window=(window_size_left, window_size_right), softcap=softcap))
        # the attention backward written out: dV = P^T dO, dS = P (dP - rowsum(dP P)), dP = dO V^T
        p = self._probs(q, k, cu_seqlens_q, window_size_left, scale)  # [H, T, T]
        dp = torch.einsum("qhd,khd->hqk", dout, v)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq = scale * torch.einsum("hqk,khd->qhd", ds, k)
        dk = scale * torch.einsum("hqk,qhd->khd", ds, q)
        dv = torch.einsum("hqk,qhd->khd", p, dout)
        return dq, dk, dv


@pytest.fixture
def stand_in(monkeypatch):
    fake = _StandIn()
    monkeypatch.setattr(attention_fa4, "_interface", lambda: fake)
    return fake


def _inputs(lengths, seed=0):
    t = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    return q, k, v, _cu(lengths, capacity=6)


@pytest.mark.parametrize("compiled", [False, True])
def test_ops_give_the_reference_output_and_gradients(stand_in, compiled):
    q, k, v, cu = _inputs([40, 7, 17])
    run = torch.compile(attention, fullgraph=True, dynamic=False, backend="aot_eager") if compiled \
        else attention
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = run(*leaves, cu, 40, 9, SCALE, "fa4")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_leaves, cu, 9, SCALE)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
    assert torch.allclose(out, ref)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r)
    fwd, bwd = (c for c in stand_in.calls if c["kind"] in ("fwd", "bwd"))
    assert fwd == dict(kind="fwd", same_cu=True, causal=True, window=(9, 0), lse=True,
                       max_seqlen=(40, 40))
    assert bwd == dict(kind="bwd", same_cu=True, causal=True, window=(9, 0), softcap=0.0)


def test_refused_without_cuda_or_the_package():
    with pytest.raises(ValueError, match="'fa4' cannot run on cpu: needs CUDA; use 'flex'"):
        resolve_backend("fa4", torch.device("cpu"))
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ImportError, match="needs flash-attn-4 .*scripts/gpu/fa4_wheels.sh"):
            attention_fa4._interface()
