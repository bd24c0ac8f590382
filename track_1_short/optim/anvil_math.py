"""The per-shard update math of AnvilAndAdam (optim/anvil.py): pure functions on fp32 tensors.

What it replaces: the compiled `@staticmethod`s inside modded-nanogpt's NorMuonAndAdam
(facts section 4: Nesterov, NorMuon variance normalisation, cautious update, fused Adam). Kept apart
from the orchestration so that tests/test_anvil_math.py can check each one against a float64
reference, and so that `AnvilConfig.compile` can wrap exactly the five step functions below in
torch.compile(dynamic=False, fullgraph=True).

Step functions (what the optimizer calls, eager or compiled; each one pass per shard as far as the
math allows):
- `anvil_bank_step_`: one bank shard's whole ANVIL update (nesterov_ -> polar_express -> normuon_
  -> cautious_anvil_update_ -> master rounded into the bf16 shard). Compiled, the elementwise work
  fuses into ~4 memory passes around Polar Express's 15 bmm (eager: ~25 passes).
- `adam_step_`: one table's Adam (moments, bias-corrected update, cautious decay, master rounding,
  zeroing the gradient buffer it consumed); compiled, one pass (eager: ~16).
- `adam_group_step_`: adam_step_ over a list of small parameters in one compiled call.
- `fold_tied_grad_`, `copy_transposed_`: the tied embed/lm_head's gradient fold and weight copy,
  transposes that eager torch runs at a fraction of the bandwidth.
The building blocks (nesterov_, normuon_, cautious_anvil_update_, adam_update_) are the definitions
the float64 references check; the step functions only compose them.

What must stay stable: every function updates its state arguments IN PLACE (momentum, second
moment, Adam moments, the fp32 parameter or master shard, the bf16 output shard); none allocates
persistent memory. Values that change per step (momentum, lr, step size, decay) are 0-d tensors
(the step functions read them from the optimizer's StepValues vector on the parameters' device), so
a compiled graph sees them as inputs and one graph per shard shape serves every step (facts 4.2);
betas are 0-d tensors too, so parameters of one shape and different betas share a graph. The
building blocks also take Python floats (the tests' references do).

Call order (per bank shard, every step): anvil_bank_step_. Per Adam table (Adam steps only):
adam_step_; the small replicated parameters: one adam_group_step_.

Provenance: modded-nanogpt HEAD f411b3d3 `train_gpt.py:869-947` (facts 4.1, 4.2). Deviations: the
parameter is an fp32 tensor here (a master copy when the model is bf16, see anvil.py) instead of
bf16 + uint16 mantissa; same arithmetic otherwise.

Legend: K matrices in this rank's shard, R rows, C cols.
"""

import torch
from torch import Tensor

from track_1_short.optim.polar_express import PolarGemms, polar_express

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


def adam_update_(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, beta1, beta2,
                 eps: float, step_size, eff_wd) -> None:
    """Adam with bias correction folded into step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t),
    plus cautious weight decay: where update*p > 0, add eff_wd*p (eff_wd = lr^2 * wd * wd_mul).
    p, exp_avg, exp_avg_sq fp32 of one shape, updated in place; grad any float dtype; betas,
    step_size and eff_wd Python floats or 0-d tensors."""
    g = grad.float()
    exp_avg.mul_(beta1).add_(g * (1 - beta1))
    exp_avg_sq.mul_(beta2).add_(g * g * (1 - beta2))
    update = exp_avg / (exp_avg_sq.sqrt() + eps) * step_size
    mask = (update * p) > 0
    update.add_(p * mask * eff_wd)
    p.sub_(update)


def anvil_bank_step_(grad: Tensor, momentum: Tensor, second_moment: Tensor, target: Tensor,
                     out: Tensor | None, lr_mul: Tensor, scalars: Tensor, beta2: float,
                     ortho_dtype: torch.dtype, coeffs, gemms: PolarGemms | None = None) -> None:
    """One bank shard's ANVIL step. grad [K, R, C] (any float dtype); momentum, target (fp32
    parameter or master) [K, R, C] and second_moment (see normuon_) updated in place; out: the bf16
    shard [K, R, C] the master is rounded into (None when target is the parameter); lr_mul [K, 1, 1];
    scalars [3] fp32 = (momentum mu, lr, weight_decay * lr); gemms: Polar Express's GEMM strategy
    (None: torch's; a compiled graph guards on the object, one graph per strategy)."""
    mu, lr, wd_lr = scalars[0], scalars[1], scalars[2]
    v = nesterov_(momentum, grad, mu)  # [K, R, C] fp32
    v = polar_express(v, ortho_dtype, coeffs, gemms).float()
    v = normuon_(v, second_moment, beta2)
    cautious_anvil_update_(target, v, lr_mul * lr, wd_lr)
    if out is not None:
        out.copy_(target)


def adam_step_(target: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, hyper: Tensor,
               eps: float, out: Tensor | None, zero_grad: bool) -> None:
    """One Adam parameter (or shard): adam_update_ on target (fp32 parameter or master), then the
    master rounded into `out` (None when target is the parameter) and, with zero_grad, `grad`
    zeroed in place (a persistent buffer consumed here). hyper [4] fp32 = (beta1, beta2, step_size,
    eff_wd)."""
    adam_update_(target, grad, exp_avg, exp_avg_sq, hyper[0], hyper[1], eps, hyper[2], hyper[3])
    if out is not None:
        out.copy_(target)
    if zero_grad:
        grad.zero_()


def fold_tied_grad_(head_grad: Tensor, embed_grad: Tensor, zero_embed: bool) -> None:
    """Tied embed/lm_head on an Adam step: lm_head's gradient [d, V] += embed's [V, d] transposed
    (in place); with zero_embed, embed's (a persistent buffer its owner accumulates afresh) zeroed
    in the same pass. Compiled, one tiled pass (eager: a strided add at ~1/3 of the bandwidth and
    a memset)."""
    head_grad.add_(embed_grad.T)
    if zero_embed:
        embed_grad.zero_()


def copy_transposed_(dst: Tensor, src: Tensor) -> None:
    """dst [V, d] <- src [d, V] transposed, in place (embed <- lm_head while tied). Compiled, one
    tiled pass (eager: a strided copy)."""
    dst.copy_(src.T)


def adam_group_step_(targets: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                     exp_avg_sqs: list[Tensor], hypers: Tensor, eps: float,
                     outs: list[Tensor | None], zero_grads: list[bool]) -> None:
    """adam_step_ over a list of parameters; hypers [n, 4] (row i: parameter i's hyper)."""
    for i, target in enumerate(targets):
        adam_step_(target, grads[i], exp_avgs[i], exp_avg_sqs[i], hypers[i], eps, outs[i],
                   zero_grads[i])
