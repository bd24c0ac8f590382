"""Rotary position tables with YaRN window extension: three address-stable instances on the GPT.

What it replaces: HEAD modded-nanogpt's `Yarn` (train_gpt.py:988-1055), whose `reset()` re-created
its table tensors. Here `extend_window()` and `reset()` only ever `copy_` into the registered
buffers, so a CUDA graph that baked the tables' addresses stays valid across stage transitions and
the post-warmup reset.

Math (modded-nanogpt record facts 1.3):
- half-truncated RoPE: head_dim/4 frequencies (1/1024)^linspace(0, 1, head_dim/4), each shared by an
  adjacent (interleaved) dim pair, so dims [0, head_dim/2) rotate and [head_dim/2, head_dim) are
  stationary (frequency 0).
- positions are absolute positions in the packed per-rank buffer (RoPE is relative, so documents
  need no per-document offset).
- YaRN `extend_window(old, new)` (HEAD's `apply`): per frequency f, r = old*f/(2*pi) rotations in
  the old window, w = clamp((r - 1)/31, 0, 1), f <- f*(s + w*(1 - s)) with s = old/new; attention
  softmax scale x (1 + 0.2 ln(new/old)), starting at 0.1: 0.1 -> 0.11695 -> 0.12752 -> 0.13178 over windows
  384 -> 896 -> 1408 -> 1664.
- `paired=True` (the `yarn_paired_head` instance): rows are 2*head_dim wide; row t holds the
  head_dim table at position 2t followed by the one at 2t+1 (paired-head attention interleaves the
  two heads of a pair along the doubled sequence, facts 1.2).

What must stay stable: `cos`, `sin`, `freqs` (and `freqs_init`) are registered buffers that are
written in place only. `attn_scale` is a Python float the compiled forward bakes; the step graphs
re-check it at every replay (seed: StepGraphs._attn_scales).

Call order: built by GPT.__init__; GPT.set_yarn_window(ws_long) before every training step, which
calls GPT.apply_window_change(old, new) where ws_long changes (eagerly, outside the compiled
forward); GPT.reset_yarn() in the post-warmup reset.

Deviations: a `wide` third instance (for the long-window layers, own attn_scale) does not exist in
HEAD; by default it follows ws_long exactly like the other two (see GPT.apply_window_change).
Tables are float32 and `freqs` float64 (HEAD: bf16 tables); rotate() casts to the activation dtype.
Never cast the whole model with model.to(dtype): cast parameters only (HEAD does the same).

Legend: P table rows (positions), D head_dim, W table width (D, or 2D when paired), F frequencies.
"""

import math

import torch
from torch import Tensor, nn

INITIAL_ATTN_SCALE = 0.1


def base_frequencies(head_dim: int) -> Tensor:
    """Angular frequency per rotating dim pair, zeros for the stationary pairs."""
    num_rot = head_dim // 4
    rot = (1.0 / 1024.0) ** torch.linspace(0.0, 1.0, num_rot, dtype=torch.float64)
    return torch.cat([rot, torch.zeros(head_dim // 2 - num_rot, dtype=torch.float64)])  # [F=D/2]


def yarn_frequencies(freqs: Tensor, old_window: int, new_window: int) -> Tensor:
    """facts 1.3: interpolate low frequencies by old/new, keep those with >= 32 rotations."""
    s = old_window / new_window
    rotations = old_window * freqs / (2 * math.pi)
    w = ((rotations - 1.0) / 31.0).clamp(0.0, 1.0)
    return freqs * (s + w * (1.0 - s))


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved pair rotation: (a, b) -> (a cos - b sin, b cos + a sin). x [..., W], cos/sin
    broadcastable [..., W] with each value repeated over its pair."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    swapped = torch.stack((-b, a), dim=-1).flatten(-2)
    return x * cos + swapped * sin


class Yarn(nn.Module):
    """cos/sin tables [P, W] (float32) plus the attention softmax scale."""

    def __init__(self, head_dim: int, max_position: int, paired: bool = False):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 4 for half-truncated RoPE")
        self.head_dim = head_dim
        self.max_position = max_position
        self.paired = paired
        self.attn_scale: float = INITIAL_ATTN_SCALE
        freqs = base_frequencies(head_dim)  # [F]
        cos, sin = self._tables(freqs)
        self.register_buffer("freqs", freqs)
        self.register_buffer("cos", cos)  # [P, W]
        self.register_buffer("sin", sin)  # [P, W]
        # reset() recomputes the tables from this copy into the same buffers (non-persistent: derived)
        self.register_buffer("freqs_init", freqs.clone(), persistent=False)

    def _tables(self, freqs: Tensor) -> tuple[Tensor, Tensor]:
        rows = 2 * self.max_position if self.paired else self.max_position
        pos = torch.arange(rows, dtype=torch.float64, device=freqs.device)
        angle = torch.outer(pos, freqs).repeat_interleave(2, dim=-1)  # [rows, D]
        if self.paired:
            angle = angle.view(self.max_position, 2 * self.head_dim)  # row t = positions 2t, 2t+1
        return angle.cos().float(), angle.sin().float()

    @torch.no_grad()
    def extend_window(self, old_window: int, new_window: int):
        """Extend the context from old_window to new_window tokens, in place (eager only). HEAD
        calls this `apply`, which would override nn.Module.apply(fn) with another meaning."""
        if old_window <= 0 or new_window <= 0:
            raise ValueError(f"YaRN windows must be positive (old={old_window}, new={new_window})")
        self._set_freqs(yarn_frequencies(self.freqs, old_window, new_window))
        self.attn_scale *= 1.0 + 0.2 * math.log(new_window / old_window)

    @torch.no_grad()
    def reset(self):
        """Initial tables and scale, in place (post-warmup reset)."""
        self._set_freqs(self.freqs_init)
        self.attn_scale = INITIAL_ATTN_SCALE

    def _set_freqs(self, freqs: Tensor):
        self.freqs.copy_(freqs)
        cos, sin = self._tables(self.freqs)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def head_tables(self) -> tuple[Tensor, Tensor]:
        """cos, sin [rows, D] (views): row n is the table of a single head's row at position n.
        The plain tables as they are; a paired table read as [2P, D], an ordinary table of the
        doubled positions (its row t holds positions 2t and 2t+1)."""
        d = self.head_dim
        return self.cos.view(-1, d), self.sin.view(-1, d)

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [N, H, W] rotated by the first N rows of the tables cos, sin [rows, W]."""
        n = x.shape[0]
        return rotate_pairs(x, cos[:n, None, :].to(x.dtype), sin[:n, None, :].to(x.dtype))

    def rotate(self, x: Tensor) -> Tensor:
        """x [T, H, W] at positions 0..T-1 of the packed buffer (T <= max_position)."""
        return self._rotate(x, self.cos, self.sin)

    def rotate_doubled(self, x: Tensor) -> Tensor:
        """x [2T, H/2, D] in attention.pair_heads' layout (a paired table only): row n at doubled
        position n, rotated by head_tables(). Equals pair_heads(rotate(z.reshape(T, H/2, 2D))
        .view(T, H, D)) for x = pair_heads(z), element by element, with the rotation writing the
        paired layout."""
        if not self.paired:
            raise ValueError("Yarn.rotate_doubled needs the paired table (Yarn(paired=True))")
        return self._rotate(x, *self.head_tables())
