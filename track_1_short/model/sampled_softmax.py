"""Sampled softmax: the training loss over P candidate vocabulary rows instead of all V.

What it replaces: the full V-way softcapped softmax of the training loss (loss.py). With P << V the
lm-head GEMM and the logits shrink by V/P. Not in HEAD modded-nanogpt (facts section 0: HEAD uses
the full 50304-way CE); this is our design's option, off by default (`cfg.sampled_loss=None`).

Math: candidates = every distinct target (and prefix target) of the step, plus uniformly sampled
negatives; logits of candidate c are corrected by -log q_c, q_c its inclusion probability (1 for the
targets, (P - U) / (V - U) for negatives, U distinct targets), the standard log-q correction. MTP and
prefix terms reuse loss.training_loss on the [T, P] corrected logits with candidate indices as targets.
With rows = all of the vocabulary and log_q = 0 it equals the full softmax CE (test_loss.py).

What must stay stable: one SampledSoftmax per P, allocated once (`allocate`), refilled in place
(`refill_`, eager, before the forward) every step; the step graphs bake its four tensors and check
that the key's object is the live one (seed: `cfg.sampled_loss is cs.cfg.sampled_loss`).

Legend: T tokens, P candidates, V vocab.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class SampledSoftmax:
    rows: Tensor  # int64 [P] candidate vocab ids, sorted ascending
    log_q: Tensor  # float32 [P] log inclusion probability (the correction)
    target_index: Tensor  # int64 [T] index into rows of targets[i]
    prefix_index: Tensor  # int64 [T] index into rows of the prefix target, -1 = no prefix term

    @classmethod
    def allocate(cls, num_candidates: int, num_tokens: int, device) -> "SampledSoftmax":
        return cls(
            rows=torch.zeros(num_candidates, dtype=torch.int64, device=device),
            log_q=torch.zeros(num_candidates, dtype=torch.float32, device=device),
            target_index=torch.zeros(num_tokens, dtype=torch.int64, device=device),
            prefix_index=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        )

    @torch.no_grad()
    def set_candidates_(self, rows: Tensor, log_q: Tensor, targets: Tensor, prefix_targets: Tensor):
        """Explicit candidates (sorted rows containing every target); fills all four in place."""
        if rows.shape != self.rows.shape or targets.shape != self.target_index.shape:
            raise ValueError(f"candidates {tuple(rows.shape)} / targets {tuple(targets.shape)} do not "
                             f"match this SampledSoftmax ({self.rows.shape[0]}, "
                             f"{self.target_index.shape[0]}); allocate one per (P, T)")
        self.rows.copy_(rows)
        self.log_q.copy_(log_q)
        self.target_index.copy_(torch.searchsorted(rows, targets))
        has = prefix_targets >= 0
        idx = torch.searchsorted(rows, prefix_targets.clamp(min=0))
        self.prefix_index.copy_(torch.where(has, idx, -1))

    @torch.no_grad()
    def refill_(self, targets: Tensor, prefix_targets: Tensor, vocab_size: int,
                generator: torch.Generator | None = None):
        """Targets + uniform negatives for this step (eager; torch.unique syncs the host)."""
        num = self.rows.shape[0]
        needed = torch.cat([targets, prefix_targets[prefix_targets >= 0]]).unique()  # [U]
        u = needed.numel()
        if u > num:
            raise ValueError(f"{u} distinct targets > {num} sampled-softmax candidates; raise P")
        scores = torch.rand(vocab_size, generator=generator, device=targets.device)
        scores[needed] = -1.0
        negatives = scores.topk(num - u).indices
        rows, order = torch.cat([needed, negatives]).sort()
        log_q = torch.zeros(num, dtype=torch.float32, device=rows.device)
        if num > u:
            log_q_neg = math.log((num - u) / (vocab_size - u))
            log_q = torch.where(order >= u, log_q_neg, 0.0).float()
        self.set_candidates_(rows, log_q, targets, prefix_targets)
