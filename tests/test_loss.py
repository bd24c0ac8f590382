"""Losses: softcap, plain CE vs torch, MTP and prefix-token terms vs direct loops, the prefix table
builder on a fake byte vocabulary (and the real GPT-2 one when the tokenizer module is present).

Hardware: CPU only, < 10 s. Run: `.venv/bin/python -m pytest tests/test_loss.py -q`.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from track_1_short.model.loss import build_prefix_table, per_token_ce, softcap, training_loss

V = 37


def _capped(t=11, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return softcap(torch.randn(t, v, generator=g, dtype=torch.float64) * 10).double()


def test_softcap_formula_and_range():
    z = torch.tensor([-1e4, -5.0, 0.0, 1e4])
    out = softcap(z)
    assert out[0] == 0 and out[-1] == 23
    assert out[1] == pytest.approx(11.5)
    assert out[2] == pytest.approx(23 / (1 + math.exp(-5 / 7.5)))


def test_plain_ce_matches_torch():
    capped = _capped()
    targets = torch.randint(0, V, (11,))
    ref = F.cross_entropy(capped, targets, reduction="none")
    assert torch.allclose(per_token_ce(capped, targets), ref)
    none = torch.full((11,), -1)
    loss = training_loss(capped, targets, torch.tensor([1.0]), torch.tensor(0.3), none)
    assert torch.allclose(loss, ref)


def test_mtp_and_prefix_match_direct_loops():
    t = 11
    capped = _capped(t)
    targets = torch.randint(0, V, (t,))
    prefix = torch.randint(-1, V, (t,))
    weights = torch.tensor([1.0, 0.5, 0.125], dtype=torch.float64)
    pw = torch.tensor(0.25, dtype=torch.float64)
    loss = training_loss(capped, targets, weights, pw, prefix)
    lse = torch.logsumexp(capped, -1)
    for i in range(t):
        expect = sum(weights[k] * (lse[i] - capped[i, targets[i + k]]) for k in range(3) if i + k < t)
        if prefix[i] >= 0:
            expect = expect + pw * (lse[i] - capped[i, prefix[i]])
        assert loss[i].item() == pytest.approx(float(expect), rel=1e-12)


def test_prefix_table_on_fake_vocabulary():
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"th": 256, b"the": 257, b"there": 258, b"thx": 259, b"ere": 260})
    table = build_prefix_table(ranks, vocab_size=264)
    assert table[ord("t")] == -1  # single byte: no proper prefix token
    assert table[256] == ord("t") and table[257] == 256 and table[259] == 256
    assert table[258] == 257  # "there" -> "the" (longest, "ther" is not a token)
    assert table[260] == ord("e")
    assert torch.all(table[261:] == -1)  # padding / special ids
    with pytest.raises(ValueError, match="vocab_size"):
        build_prefix_table(ranks, vocab_size=100)


def test_prefix_table_real_gpt2_vocab():
    tokenizer = pytest.importorskip("track_1_short.tokenizer")
    enc = tokenizer.get_encoding()
    table = build_prefix_table(enc._mergeable_ranks, 50304)
    the = enc.encode(" the")[0]
    assert enc.decode([int(table[the])]) in (" th", " t")
    assert table[50256] == -1
