"""The per-shard update math of AnvilAndAdam (optim/anvil.py): pure functions on fp32 tensors.

What it replaces: the compiled `@staticmethod`s inside modded-nanogpt's NorMuonAndAdam
(facts section 4: Nesterov, NorMuon variance normalisation, cautious update, fused Adam). Kept apart
from the orchestration so that tests/test_anvil_math.py can check each one against a float64
reference, and so that `AnvilConfig.compile` can wrap exactly these functions in
torch.compile(dynamic=False, fullgraph=True).

What must stay stable: every function updates its state arguments IN PLACE (momentum, second
moment, Adam moments, the fp32 parameter or master shard); none allocates persistent memory. Scalars
that change per step (momentum, lr, step size, decay) may be 0-d CPU tensors, so a compiled version
sees them as inputs instead of specialising on their values (facts 4.2); per-parameter constants
(betas, eps) are Python floats.

Call order (per bank shard, every step): nesterov_ -> polar_express (polar_express.py) -> normuon_
-> cautious_anvil_update_. Per Adam shard (Adam steps only): adam_update_.

Provenance: modded-nanogpt HEAD f411b3d3 `train_gpt.py:869-947` (facts 4.1, 4.2). Deviations: the
parameter is an fp32 tensor here (a master copy when the model is bf16, see anvil.py) instead of
bf16 + uint16 mantissa; same arithmetic otherwise.

Legend: K matrices in this rank's shard, R rows, C cols.
"""

from torch import Tensor

SECOND_MOMENT_FLOOR = 1e-10  # keeps rsqrt finite for all-zero rows (padding matrices of a bank)


def nesterov_(momentum: Tensor, grad: Tensor, mu) -> Tensor:
    """buf <- mu*buf + (1-mu)*g (in place); returns g' = (1-mu)*g + mu*buf, fp32 [K, R, C]."""
    g = grad.float()
    momentum.mul_(mu).add_(g * (1 - mu))
    return g * (1 - mu) + momentum * mu


def reduced_dim(rows: int, cols: int) -> int:
    """NorMuon averages v^2 along cols for tall or square matrices, along rows for wide ones."""
    return -1 if rows >= cols else -2


def normuon_(v: Tensor, second_moment: Tensor, beta2) -> Tensor:
    """NorMuon variance normalisation of v [K, R, C] (fp32, modified in place and returned).

    second_moment [K, R, 1] (R >= C) or [K, 1, C] (wide): EMA (beta2, no bias correction) of the
    mean of v^2 along the reduced dim. v is scaled by rsqrt(EMA), then each matrix is rescaled so its
    Frobenius norm is unchanged: ||v||^2 = n * sum(mean_sq), ||v*s||^2 = n * sum(mean_sq * s^2).
    """
    red = reduced_dim(v.size(-2), v.size(-1))
    mean_sq = v.square().mean(dim=red, keepdim=True)  # same shape as second_moment
    second_moment.mul_(beta2).add_(mean_sq * (1 - beta2))
    scale = second_moment.clamp_min(SECOND_MOMENT_FLOOR).rsqrt()
    before = mean_sq.sum(dim=(-2, -1), keepdim=True)  # [K, 1, 1]
    after = (mean_sq * scale.square()).sum(dim=(-2, -1), keepdim=True)  # [K, 1, 1]
    return v.mul_(scale * (before / after.clamp_min(SECOND_MOMENT_FLOOR)).sqrt())


def cautious_anvil_update_(p: Tensor, v: Tensor, lr_eff: Tensor, wd_lr) -> None:
    """p [K, R, C] fp32, in place: mask = (v*p >= 0); p <- p - mask*p*wd_lr*lr_eff - lr_eff*v.

    lr_eff [K, 1, 1] = lr * lr_mul * shape_mult (per matrix); wd_lr = weight_decay * lr, so the decay
    scales with lr^2 ("tied to the lr", facts 4.1 step 4).
    """
    mask = (v * p) >= 0
    p.sub_(p * mask * (lr_eff * wd_lr) + v * lr_eff)


def adam_update_(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, beta1: float,
                 beta2: float, eps: float, step_size, eff_wd) -> None:
    """Adam with bias correction folded into step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t),
    plus cautious weight decay: where update*p > 0, add eff_wd*p (eff_wd = lr^2 * wd * wd_mul).
    p, exp_avg, exp_avg_sq fp32 of one shape, updated in place; grad any float dtype."""
    g = grad.float()
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    update = exp_avg / (exp_avg_sq.sqrt() + eps) * step_size
    mask = (update * p) > 0
    update.add_(p * mask * eff_wd)
    p.sub_(update)
