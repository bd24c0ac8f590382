"""Attention backends: the dense reference against an explicit per-document loop; FlexAttention
(block mask from document bounds) against the reference on CPU; paired heads; backend selection.

Hardware: CPU. FlexAttention has no CPU backward in torch 2.13, so flex is compared forward-only
(eager, unfused). GPU capture/replay parity of flex lives in the GPU tests (marked `gpu`).
Run: `.venv/bin/python -m pytest tests/test_attention.py -q` (~15 s).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from track_1_short.model.attention import (attention, document_ids, flex_attention, pair_heads,
                                           pair_major_columns, paired_rows, reference_attention,
                                           resolve_backend, unpair_heads)
from track_1_short.model.gpt import GPT, GPTConfig
from track_1_short.perf.ngram_store import NgramStore


def _cu(lengths, capacity):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu + [cu[-1]] * (capacity - len(cu)), dtype=torch.int32)


def _loop_reference(q, k, v, cu, window, scale):
    """Per document, per query: explicit softmax over the allowed keys."""
    out = torch.zeros_like(q)
    bounds = cu.tolist()
    for s, e in zip(bounds, bounds[1:]):
        for i in range(s, e):
            lo = max(s, i - window)
            scores = torch.einsum("hd,jhd->hj", q[i], k[lo: i + 1]) * scale
            out[i] = torch.einsum("hj,jhd->hd", scores.softmax(-1), v[lo: i + 1])
    return out


def _qkv(t, h=2, d=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(t, h, d, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("window", [0, 3, 20, 1000])
def test_reference_matches_loop(window):
    q, k, v = _qkv(48)
    cu = _cu([10, 1, 25, 12], capacity=8)
    ref = reference_attention(q, k, v, cu, window, scale=0.3)
    assert torch.allclose(ref, _loop_reference(q, k, v, cu, window, 0.3), atol=1e-10)


def test_document_ids_with_padding():
    cu = _cu([3, 2], capacity=5)
    assert document_ids(cu, 5).tolist() == [0, 0, 0, 1, 1]


def test_causality_and_document_isolation():
    q, k, v = _qkv(40)
    cu = _cu([15, 25], capacity=4)
    base = reference_attention(q, k, v, cu, 1000, 0.2)
    k2, v2 = k.clone(), v.clone()
    k2[30:], v2[30:] = torch.randn(10, 2, 16, dtype=k.dtype), 5.0  # future keys in document 1
    moved = reference_attention(q, k2, v2, cu, 1000, 0.2)
    assert torch.equal(base[:30], moved[:30])
    k3 = k.clone()
    k3[:15] = 3.0  # document 0 cannot affect document 1
    assert torch.equal(base[15:], reference_attention(q, k3, v, cu, 1000, 0.2)[15:])


@pytest.mark.parametrize("lengths,window", [([256], 300), ([100, 156], 64), ([5, 130, 1, 120], 17),
                                            ([300, 212], 128), ([512], 0)])
def test_flex_matches_reference(lengths, window):
    t = sum(lengths)
    q, k, v = _qkv(t, h=2, d=32, dtype=torch.float32)
    cu = _cu(lengths, capacity=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        out = flex_attention(q, k, v, cu, window, scale=0.12)
    ref = reference_attention(q, k, v, cu, window, scale=0.12)
    assert torch.allclose(out, ref, atol=1e-5)


def test_flex_rejects_unaligned_tokens():
    q, k, v = _qkv(100, dtype=torch.float32)
    with pytest.raises(ValueError, match="tokens % 128"):
        flex_attention(q, k, v, _cu([100], 2), 10, 0.1)


def test_pair_heads_roundtrip_and_layout():
    x = torch.randn(5, 6, 4)
    p = pair_heads(x)
    assert p.shape == (10, 3, 4)
    assert torch.equal(p[2 * 3, 1], x[3, 2]) and torch.equal(p[2 * 3 + 1, 1], x[3, 3])
    assert torch.equal(unpair_heads(p), x)


@pytest.mark.parametrize("heads", [4, 6])
def test_paired_rows_read_by_permuted_columns_equal_the_unpaired_copy(heads):
    """paired_rows is a view (no copy) of the paired attention output; a projection with its
    columns put in pair-major order computes what the unpaired copy's projection does. Six heads
    (the speedrun's) and four: with two heads the permutation is the identity and proves nothing."""
    torch.manual_seed(0)
    t, d, n = 5, 8, 7
    out = torch.randn(2 * t, heads // 2, d, dtype=torch.float64)  # [2T, H/2, D]
    w = torch.randn(n, heads * d, dtype=torch.float64)  # [N, H*D]
    rows = paired_rows(out)
    assert rows.shape == (t, heads * d) and rows.data_ptr() == out.data_ptr()
    ref = F.linear(unpair_heads(out).reshape(t, heads * d), w)
    assert torch.allclose(F.linear(rows, pair_major_columns(w, heads)), ref, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(F.linear(rows, w), ref)  # the permutation is not the identity


def test_resolve_backend():
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    assert resolve_backend("auto", torch.device("cuda")) == "flex"
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend("varlen", torch.device("cpu"))
    with pytest.raises(ValueError, match="not resolved"):
        q, k, v = _qkv(4)
        attention(q, k, v, _cu([4], 2), 4, 4, 0.1, "auto")


def test_model_flex_matches_reference_with_paired_heads_and_key_offset():
    """Whole tiny model (paired-head layers, long layers with the partial key offset, short
    windows, several documents): eval CE with flex equals reference."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    with torch.no_grad():
        model.vo_bank.normal_(0, 0.05)  # non-zero attention output so attention matters
    t = 256
    inputs = torch.randint(0, 50257, (t,), dtype=torch.int32)
    cu = _cu([40, 100, 3, 113], capacity=8)
    inputs[cu[:4].long()] = 50256
    targets = torch.randint(0, 50257, (t,))
    slots = NgramStore(model.ngram_table, cycle=1, micro_steps=1).slots_for(inputs)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = model.eval_ce(inputs, targets, cu, slots, 24, 72, 128)
        model.attention_backend = "flex"
        flex = model.eval_ce(inputs, targets, cu, slots, 24, 72, 128)
    assert torch.allclose(ref, flex, atol=1e-4)
