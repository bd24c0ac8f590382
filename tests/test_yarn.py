"""Yarn rotary tables: YaRN scale schedule, frequency update, in-place (address-stable)
extend_window/reset, paired-table layout, relative-position property.

Hardware: CPU only, < 5 s. Run: `.venv/bin/python -m pytest tests/test_yarn.py -q`.
"""

import math

import pytest
import torch

from track_1_short.model.gpt import GPT, GPTConfig
from track_1_short.model.yarn import INITIAL_ATTN_SCALE, Yarn, base_frequencies, yarn_frequencies

WINDOWS = (384, 896, 1408, 1664)  # ws_long per stage (facts 3)


def _ptrs(y: Yarn):
    return [b.data_ptr() for b in y.buffers()]


def test_scale_schedule_and_addresses_stable():
    y = Yarn(head_dim=128, max_position=512)
    ptrs = _ptrs(y)
    scales = [y.attn_scale]
    for old, new in zip(WINDOWS, WINDOWS[1:]):
        y.extend_window(old, new)
        scales.append(y.attn_scale)
        assert _ptrs(y) == ptrs
    assert scales == pytest.approx([0.1, 0.11695, 0.12752, 0.13178], abs=5e-6)
    y.reset()
    assert _ptrs(y) == ptrs
    assert y.attn_scale == INITIAL_ATTN_SCALE
    fresh = Yarn(head_dim=128, max_position=512)
    assert torch.equal(y.cos, fresh.cos) and torch.equal(y.sin, fresh.sin)


def test_frequency_update_rule():
    f = base_frequencies(128)
    assert f.shape == (64,) and torch.all(f[32:] == 0) and f[0] == 1.0
    g = yarn_frequencies(f, 384, 896)
    rotations = 384 * f / (2 * math.pi)
    fast = rotations >= 32
    assert torch.equal(g[fast], f[fast])  # >= 32 rotations: unchanged
    slow = rotations <= 1
    assert torch.allclose(g[slow], f[slow] * 384 / 896)  # <= 1 rotation: interpolated by old/new


def test_tables_update_in_place_after_extend_window():
    y = Yarn(head_dim=64, max_position=256)
    before = y.cos.clone()
    y.extend_window(384, 896)
    assert not torch.equal(before, y.cos)
    assert torch.allclose(y.cos[:, 32:], torch.ones_like(y.cos[:, 32:]))  # stationary half
    assert torch.all(y.sin[:, 32:] == 0)


@pytest.mark.parametrize("paired", [False, True])
def test_the_stationary_half_is_exactly_cos_1_sin_0_at_every_window(paired):
    """kernels/qk_norm_rope.py reads only the rotating columns [0, D/2) of head_tables() and takes
    cos 1, sin 0 for the rest: those values must hold exactly, at every window and after reset."""
    d = 32
    y = Yarn(head_dim=d, max_position=64, paired=paired)

    def check():
        cos, sin = y.head_tables()  # [rows, D]
        assert torch.equal(cos[:, d // 2:], torch.ones_like(cos[:, d // 2:]))
        assert torch.equal(sin[:, d // 2:], torch.zeros_like(sin[:, d // 2:]))
        assert not torch.equal(sin[1:, :d // 2], torch.zeros_like(sin[1:, :d // 2]))  # the rest moves

    check()
    for old, new in zip(WINDOWS, WINDOWS[1:]):
        y.extend_window(old, new)
        check()
    y.reset()
    check()


def test_paired_table_interleaves_positions():
    plain = Yarn(head_dim=64, max_position=64)
    paired = Yarn(head_dim=64, max_position=32, paired=True)
    assert paired.cos.shape == (32, 128)
    assert torch.allclose(paired.cos[5, :64], plain.cos[10]) and torch.allclose(paired.cos[5, 64:], plain.cos[11])


def test_rotate_doubled_equals_the_rotation_then_the_pair_copy():
    """Yarn.rotate_doubled on the paired layout equals the paired rotation over [T, H/2, 2D]
    followed by pair_heads' copy, element by element (the same products), after a window change
    too; the plain table is refused."""
    from track_1_short.model.attention import pair_heads
    torch.manual_seed(0)
    paired = Yarn(head_dim=64, max_position=32, paired=True)
    z = torch.randn(20, 6, 64)  # [T, H, D]
    for _ in range(2):
        ref = pair_heads(paired.rotate(z.reshape(20, 3, 128)).view(20, 6, 64))
        got = paired.rotate_doubled(pair_heads(z))
        assert got.shape == (40, 3, 64) and torch.equal(got, ref)
        paired.extend_window(128, 384)
    with pytest.raises(ValueError, match="paired table"):
        Yarn(head_dim=64, max_position=32).rotate_doubled(pair_heads(z))


def test_rotation_is_relative():
    y = Yarn(head_dim=64, max_position=64)
    q, k = torch.randn(1, 1, 64, dtype=torch.float32), torch.randn(1, 1, 64)
    qs, ks = q.expand(64, 1, 64), k.expand(64, 1, 64)
    rq, rk = y.rotate(qs), y.rotate(ks)
    a = (rq[10] * rk[7]).sum()
    b = (rq[40] * rk[37]).sum()
    assert torch.allclose(a, b, atol=1e-4)
    assert torch.allclose(rq.norm(dim=-1), qs.norm(dim=-1), atol=1e-5)


def test_gpt_window_change_moves_all_three_and_module_apply_still_works():
    model = GPT(GPTConfig.tiny())
    yarns = (model.yarn, model.yarn_paired_head, model.yarn_wide)
    ptrs = [_ptrs(y) for y in yarns]
    model.apply_window_change(384, 384)  # ws_long unchanged: no YaRN update
    assert all(y.attn_scale == 0.1 for y in yarns)
    model.apply_window_change(384, 896)
    assert all(y.attn_scale == pytest.approx(0.11695, abs=5e-6) for y in yarns)
    model.reset_yarn()
    assert all(y.attn_scale == 0.1 for y in yarns)
    assert [_ptrs(y) for y in yarns] == ptrs
    seen = []
    model.apply(lambda m: seen.append(type(m).__name__))  # nn.Module.apply(fn) still recurses
    assert seen.count("Yarn") == 3


def test_set_yarn_window_applies_each_change_once():
    """A step run again (the warmup's second visit of a one-step key, a self-check) asks for the
    window the tables already serve: nothing moves, where applying the change again would
    compound it (384 -> 896 twice is not 384 -> 896). The scenario through main() is
    tests/test_train.py's one-step key test (-m slow for 2 micro-steps)."""
    model, once = GPT(GPTConfig.tiny()), GPT(GPTConfig.tiny())
    model.set_yarn_window(384)  # the first call records the base tables' window
    assert model.yarn.attn_scale == 0.1
    model.set_yarn_window(896)
    tables = [b.clone() for b in model.yarn.buffers()]
    model.set_yarn_window(896)  # the same step again
    once.apply_window_change(384, 896)
    for y in (model.yarn, model.yarn_paired_head, model.yarn_wide):
        assert y.attn_scale == pytest.approx(0.11695, abs=5e-6)
    assert all(torch.equal(a, b) for a, b in zip(model.yarn.buffers(), tables))
    assert all(torch.equal(a, b) for a, b in zip(model.yarn.buffers(), once.yarn.buffers()))
    model.set_yarn_window(1408)  # the next change goes on from 896
    once.apply_window_change(896, 1408)
    assert all(torch.equal(a, b) for a, b in zip(model.yarn.buffers(), once.yarn.buffers()))


def test_bad_window_raises():
    with pytest.raises(ValueError, match="positive"):
        Yarn(64, 16).extend_window(0, 128)
