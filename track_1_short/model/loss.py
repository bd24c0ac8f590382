"""Training and eval losses on softcapped logits: CE, multi-token prediction, prefix-token prediction.

What it replaces: HEAD modded-nanogpt's FusedSoftcappedCrossEntropy (an fp8 lm-head GEMM plus an
NVRTC kernel that writes the logit gradient in the forward, triton_kernels.py:906-1292) with plain
torch ops that torch.compile fuses. Slower (the [T, V] float32 logits are materialised) but the
backward is an ordinary autograd backward, so the loss may be used like any other tensor.

Math (modded-nanogpt record facts 1.6):
- softcap z' = 23 * sigmoid((z + 5) / 7.5)
- MTP: n = len(mtp_weights); per-token loss_i = sum_k w_k * (lse_i - z'_i[target[i + k]]) over
  i + k < T (targets of later positions in the packed buffer, crossing documents; k = 0 is the plain
  next-token CE).
- prefix-token prediction (PR #337): + prefix_weight * (lse_i - z'_i[prefix[target_i]]) where
  prefix[tok] is the token whose bytes are the longest proper prefix of tok's bytes (-1: none, term
  off). `build_prefix_table` computes that table from a tiktoken-style vocabulary.

What must stay stable: nothing here owns device memory. The prefix table is a buffer of the GPT,
filled in place by GPT.set_prefix_table. n (len(mtp_weights)) is a shape the compiled forward
specializes on; the weights' values and prefix_weight are tensors that change within a key.

Legend: T tokens, V vocab (padded), N MTP targets.
"""

import torch
from torch import Tensor

SOFTCAP_SCALE, SOFTCAP_SHIFT, SOFTCAP_DIV = 23.0, 5.0, 7.5


def softcap(logits: Tensor) -> Tensor:
    """[..., V] -> float32 [..., V] in (0, 23)."""
    return SOFTCAP_SCALE * torch.sigmoid((logits.float() + SOFTCAP_SHIFT) / SOFTCAP_DIV)


def shifted_targets(targets: Tensor, num_targets: int) -> tuple[Tensor, Tensor]:
    """targets[i + k] for k < num_targets as ([T, N] ids, [T, N] validity); invalid ids are 0."""
    t = targets.shape[0]
    padded = torch.cat([targets, targets.new_zeros(num_targets - 1)])  # [T + N - 1]
    ids = padded.unfold(0, t, 1).T.contiguous()  # [T, N]
    k = torch.arange(num_targets, device=targets.device)
    valid = torch.arange(t, device=targets.device)[:, None] + k[None, :] < t  # [T, N]
    return ids, valid


def per_token_ce(capped: Tensor, targets: Tensor) -> Tensor:
    """Plain CE per token: capped float32 [T, V], targets int64 [T] -> [T]."""
    lse = torch.logsumexp(capped, dim=-1)
    return lse - capped.gather(1, targets[:, None]).squeeze(1)


def training_loss(capped: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_weight: Tensor,
                  prefix_targets: Tensor) -> Tensor:
    """Per-token training loss [T] float32: MTP-weighted CE + prefix_weight * prefix CE.

    capped float32 [T, V], targets int64 [T], prefix_targets int64 [T] (-1: no prefix term)."""
    lse = torch.logsumexp(capped, dim=-1)  # [T]
    ids, valid = shifted_targets(targets, mtp_weights.shape[0])  # [T, N]
    picked = capped.gather(1, ids)  # [T, N]
    weights = mtp_weights.to(capped.dtype)[None, :] * valid  # [T, N]
    loss = ((lse[:, None] - picked) * weights).sum(1)  # [T]
    has_prefix = prefix_targets >= 0
    prefix_ce = lse - capped.gather(1, prefix_targets.clamp(min=0)[:, None]).squeeze(1)
    return loss + prefix_weight.to(capped.dtype) * torch.where(has_prefix, prefix_ce, 0.0)


def build_prefix_table(token_bytes: dict[bytes, int], vocab_size: int) -> Tensor:
    """int64 [vocab_size]: id of the token whose bytes are the longest proper prefix of each token's
    bytes, -1 if none (single bytes, special tokens, padding ids).

    token_bytes: tiktoken-style mergeable ranks {bytes: id} (e.g. enc._mergeable_ranks). Special
    tokens are not in it, so they get -1."""
    table = torch.full((vocab_size,), -1, dtype=torch.int64)
    for tok, tid in token_bytes.items():
        if tid >= vocab_size:
            raise ValueError(f"token id {tid} >= vocab_size {vocab_size}; pass the padded vocab size")
        for cut in range(len(tok) - 1, 0, -1):
            prefix_id = token_bytes.get(tok[:cut])
            if prefix_id is not None:
                table[tid] = prefix_id
                break
    return table
