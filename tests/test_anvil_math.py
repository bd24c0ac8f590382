"""AnvilAndAdam math against float64 references, one process, CPU.

Scope: Polar Express (coefficients re-derived; output singular values = the scalar polynomial
composition of the input's; the [0.85, 1.15] band for normalised singular values in [1e-3, 1]),
Nesterov, NorMuon normalisation, the cautious updates, Adam (float64 reference and torch.optim.Adam),
the banked ANVIL step against a per-matrix reference, the two-step Adam cadence, the value_embeds
gradient buffer, tie/untie, state_dict round trip, in-place reset, config validation, name table.
Steps take their momentum and Adam cadence from the speedrun schedule's plan (as train_step does).
Hardware: CPU only (~10 s). Run: `.venv/bin/python -m pytest tests/test_anvil_math.py -q`.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from track_1_short.optim import anvil_math
from track_1_short.optim.anvil import AnvilAndAdam
from track_1_short.optim.anvil_config import PARAM_TABLE, AnvilConfig, ParamConfig, build_param_cfgs
from track_1_short.optim.polar_express import (PE_BAND, PE_LOWER, POLAR_EXPRESS_COEFFS,
                                               derive_coefficients, polar_express)
from track_1_short.schedule import Schedule, ScheduleConfig

F64 = torch.float64
SPEEDRUN = Schedule(ScheduleConfig())  # every step's momentum and Adam cadence


def plan_step(opt, step: int, lr_scale: float) -> None:
    """opt.step with the speedrun plan's momentum and Adam cadence, as train_step calls it."""
    plan = SPEEDRUN.plan(step)
    opt.step(step, lr_scale, plan.momentum, plan.adam_step)


def compose(x, coeffs=POLAR_EXPRESS_COEFFS):
    for a, b, c in coeffs:
        x = a * x + b * x ** 3 + c * x ** 5
    return x


def svals(x):
    return torch.linalg.svdvals(x.to(F64))


# ---- Polar Express ----

def test_coefficients_rederived_from_the_paper_recipe():
    derived = torch.tensor(derive_coefficients(5), dtype=F64)
    listed = torch.tensor(POLAR_EXPRESS_COEFFS, dtype=F64)
    torch.testing.assert_close(derived, listed, rtol=1e-12, atol=0)


def test_scalar_composition_band():
    x = torch.logspace(math.log10(PE_LOWER), 0, 100_001, dtype=F64)
    y = compose(x)
    assert PE_BAND[0] <= y.min() and y.max() <= PE_BAND[1], (y.min(), y.max())
    # below the design bound the map still only grows (never overshoots the band)
    small = compose(torch.linspace(0, PE_LOWER, 1001, dtype=F64))
    assert (small.diff() > 0).all() and small.max() <= PE_BAND[1]


@pytest.mark.parametrize("shape", [(3, 32, 96), (2, 96, 24), (2, 48, 48)])
def test_polar_express_acts_on_singular_values(shape):
    g = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    out = polar_express(g, F64)
    for gi, oi in zip(g, out):
        s_in = svals(gi) / (gi.norm() * 1.02 + 1e-6)
        # the composition is not monotone on [0, 1]: compare as sorted sets
        torch.testing.assert_close(svals(oi), compose(s_in).sort(descending=True).values,
                                   rtol=1e-9, atol=1e-12)
        # same singular vectors: the output is U p(S) V^T, so it aligns with g's polar factor
        u, _, vh = torch.linalg.svd(gi, full_matrices=False)
        torch.testing.assert_close(oi, u @ torch.diag(compose(s_in)) @ vh, rtol=1e-8, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 24), cols=st.integers(2, 24), seed=st.integers(0, 2 ** 16),
       log_cond=st.floats(0.0, 2.5))
def test_polar_express_property(rows, cols, seed, log_cond):
    """Any shape, any conditioning up to 10^2.5: the output's singular values are the composition
    of the input's (float64), and those from inputs >= PE_LOWER lie in the band."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, dtype=F64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, k, dtype=F64, generator=gen))
    s = torch.logspace(0, -log_cond, k, dtype=F64)
    g = (u * s) @ v.T
    out = polar_express(g[None], F64)[0]
    s_in = s / (g.norm() * 1.02 + 1e-6)
    s_out = svals(out)
    torch.testing.assert_close(s_out, compose(s_in).sort(descending=True).values, rtol=1e-9, atol=1e-12)
    assert s_out.max() <= PE_BAND[1]
    assert (compose(s_in[s_in >= PE_LOWER]) >= PE_BAND[0]).all()


@pytest.mark.parametrize("shape", [(1, 256, 768), (1, 3072, 768), (2, 768, 256)])
def test_polar_express_band_at_bank_shapes_fp32(shape):
    """Real bank shapes (wide qk 256x768, tall mlp 3072x768) in fp32: Gaussian matrices of these
    aspect ratios have normalised singular values well above 1e-3, so all land in the band."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out = polar_express(g, torch.float32)
    for gi, oi in zip(g, out):
        assert (svals(gi) / gi.norm() / 1.02).min() >= PE_LOWER
        s = svals(oi)
        assert PE_BAND[0] - 1e-3 <= s.min() and s.max() <= PE_BAND[1] + 1e-3, (s.min(), s.max())


def test_polar_express_square_ill_conditioned():
    """Square (vo 768x768-like) with tiny singular values: those >= 1e-3 normalised are in the band,
    all outputs stay under its top."""
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(1, 192, 192, dtype=F64, generator=gen)
    out = polar_express(g, F64)
    s_in = svals(g[0]) / (g[0].norm() * 1.02 + 1e-6)
    s_out = compose(s_in)
    assert (s_in < PE_LOWER).any()
    inside = s_out[s_in >= PE_LOWER]
    assert PE_BAND[0] <= inside.min() and svals(out[0]).max() <= PE_BAND[1]


def test_polar_express_bf16_close_to_fp32():
    g = torch.randn(2, 64, 192, generator=torch.Generator().manual_seed(3))
    ref, low = polar_express(g, torch.float32), polar_express(g, torch.bfloat16).float()
    assert (low - ref).norm() / ref.norm() < 0.05


# ---- per-shard math vs float64 ----

def test_nesterov():
    gen = torch.Generator().manual_seed(4)
    buf, g = torch.randn(2, 8, 4, generator=gen), torch.randn(2, 8, 4, generator=gen)
    buf64, g64, mu = buf.to(F64), g.to(F64), 0.9
    out = anvil_math.nesterov_(buf, g, torch.tensor(mu, dtype=F64))
    buf64 = mu * buf64 + (1 - mu) * g64
    torch.testing.assert_close(buf, buf64.float())
    torch.testing.assert_close(out, ((1 - mu) * g64 + mu * buf64).float())


def normuon_reference(v, ema, beta2):
    red = -1 if v.size(-2) >= v.size(-1) else -2
    ema = beta2 * ema + (1 - beta2) * v.square().mean(dim=red, keepdim=True)
    scaled = v * ema.clamp_min(1e-10).rsqrt()
    norm = lambda t: t.square().sum(dim=(-2, -1), keepdim=True).sqrt()
    return scaled * norm(v) / norm(scaled), ema


@pytest.mark.parametrize("shape", [(3, 16, 8), (3, 8, 16), (2, 12, 12)])
def test_normuon_vs_float64(shape):
    gen = torch.Generator().manual_seed(5)
    red_shape = (shape[0], shape[1], 1) if shape[1] >= shape[2] else (shape[0], 1, shape[2])
    ema, ema64 = torch.zeros(red_shape), torch.zeros(red_shape, dtype=F64)
    for _ in range(3):
        v = torch.randn(shape, generator=gen) * torch.rand(shape[0], shape[1], 1, generator=gen)
        ref, ema64 = normuon_reference(v.to(F64), ema64, 0.9)
        out = anvil_math.normuon_(v.clone(), ema, 0.9)
        torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ema, ema64.float(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out.norm(dim=(-2, -1)), v.norm(dim=(-2, -1)), rtol=1e-5, atol=0)


def test_cautious_anvil_update_mask_includes_zero():
    p = torch.tensor([[[1.0, -1.0, 2.0, 0.0]]])
    v = torch.tensor([[[0.5, 0.5, 0.0, 1.0]]])
    lr_eff, wd_lr = torch.tensor([[[0.1]]]), 0.2
    expect = p - ((v * p) >= 0) * p * 0.2 * 0.1 - 0.1 * v
    anvil_math.cautious_anvil_update_(p, v, lr_eff, wd_lr)
    torch.testing.assert_close(p, expect)
    # element 1 (v*p < 0) is not decayed; element 2 (v*p == 0) is
    torch.testing.assert_close(p[0, 0, 1], torch.tensor(-1.0 - 0.05))
    torch.testing.assert_close(p[0, 0, 2], torch.tensor(2.0 - 2.0 * 0.02))


def adam_reference(p, grads, betas, eps, lr, eff_wd):
    """float64 Adam with bias correction and cautious decay (update*p > 0)."""
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        update = (m / (1 - betas[0] ** t)) / (v.sqrt() / math.sqrt(1 - betas[1] ** t)
                                             + eps / math.sqrt(1 - betas[1] ** t)) * lr
        update = update + ((update * p) > 0) * p * eff_wd
        p = p - update
    return p


@pytest.mark.parametrize("eff_wd", [0.0, 0.3])
def test_adam_vs_float64(eff_wd):
    gen = torch.Generator().manual_seed(6)
    p = torch.randn(5, 7, generator=gen)
    grads = [torch.randn(5, 7, generator=gen) for _ in range(4)]
    betas, eps, lr = (0.75, 0.95), 1e-10, 0.01
    ref = adam_reference(p.to(F64), [g.to(F64) for g in grads], betas, eps, lr, eff_wd)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        step_size = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)
        anvil_math.adam_update_(p, g, m, v, *betas, eps, torch.tensor(step_size, dtype=F64), eff_wd)
    torch.testing.assert_close(p, ref.float(), rtol=1e-5, atol=1e-6)


def test_adam_matches_torch_adam_without_decay():
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(6, 3, generator=gen)
    grads = [torch.randn(6, 3, generator=gen) for _ in range(5)]
    ref = nn.Parameter(p0.clone())
    opt = torch.optim.Adam([ref], lr=0.02, betas=(0.9, 0.99), eps=1e-10)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, start=1):
        ref.grad = g.clone()
        opt.step()
        anvil_math.adam_update_(p, g, m, v, 0.9, 0.99, 1e-10,
                                0.02 * math.sqrt(1 - 0.99 ** t) / (1 - 0.9 ** t), 0.0)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6)


# ---- the optimizer, one process ----

class Tiny(nn.Module):
    """Banks of every kind plus the Adam parameter kinds of the real table."""

    def __init__(self, vocab=24, dim=16, dtype=torch.float32, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        r = lambda *s, scale=0.2: nn.Parameter((torch.randn(*s, generator=gen) * scale).to(dtype))
        self.qk_bank = r(4, 8, dim)  # wide
        self.vo_bank = r(2, dim, dim)  # square
        self.mlp_bank = r(2, 2, 2 * dim, dim)  # tall, 2 slots
        self.lm_head = r(dim, vocab)
        self.embed = nn.Embedding(vocab, dim)
        self.embed.weight = nn.Parameter(self.lm_head.data.T.clone())
        self.value_embeds = nn.Embedding(2 * vocab, dim)
        self.value_embeds.weight = r(2 * vocab, dim)
        self.scalars = r(3, scale=1.0)
        self.smear_gate = r(1, 4)


def cfgs_of(model):
    return build_param_cfgs(model.named_parameters())


def random_grads(model, gen, skip=()):
    for name, p in model.named_parameters():
        if name not in skip:
            g = torch.randn(p.shape, generator=gen).to(p.dtype)
            p.grad = g if p.grad is None else p.grad + g


def make_opt(model, **kw):
    return AnvilAndAdam(cfgs_of(model), AnvilConfig(**kw), names=dict(
        (p, n) for n, p in model.named_parameters()))


def anvil_reference(p, g, mu, lr_eff, wd_lr, beta2=0.9):
    """One ANVIL step of a single matrix from zero state, float64."""
    buf = (1 - mu) * g
    v = compose_matrix((1 - mu) * g + mu * buf)
    v, _ = normuon_reference(v[None], torch.zeros(1), beta2)
    v = v[0]
    mask = (v * p) >= 0
    return p - mask * p * wd_lr * lr_eff - lr_eff * v


def compose_matrix(x):
    return polar_express(x[None], F64)[0]


def test_banked_anvil_step_matches_per_matrix_reference():
    model = Tiny()
    opt = make_opt(model)
    gen = torch.Generator().manual_seed(8)
    before = {n: p.detach().to(F64).clone() for n, p in model.named_parameters()}
    random_grads(model, gen)
    grads = {n: p.grad.to(F64).clone() for n, p in model.named_parameters()}
    plan_step(opt, 0, lr_scale=0.7)
    lr, mu, wd = 0.023 * 0.7, SPEEDRUN.plan(0).momentum, 1.2
    for name in ("qk_bank", "vo_bank", "mlp_bank"):
        p0, g, p1 = before[name], grads[name], dict(model.named_parameters())[name].detach()
        rows, cols = p0.shape[-2:]
        flat0, flatg = p0.reshape(-1, rows, cols), g.reshape(-1, rows, cols)
        for i in range(flat0.size(0)):
            slot_mul = 2.0 if name == "mlp_bank" and i % 2 else 1.0
            lr_eff = lr * slot_mul * math.sqrt(max(1.0, rows / cols))
            ref = anvil_reference(flat0[i], flatg[i], mu, lr_eff, wd * lr)
            torch.testing.assert_close(p1.reshape(-1, rows, cols)[i], ref.float(), rtol=1e-4, atol=1e-6)


def test_adam_cadence_two_step_accumulation_and_grad_buffer():
    model = Tiny()
    opt = make_opt(model, adam_lr=0.01)
    ve = model.value_embeds.weight
    buffer = torch.zeros_like(ve)
    opt.set_grad_buffer(ve, buffer)
    gen = torch.Generator().manual_seed(9)
    adam_names = ["scalars", "smear_gate", "lm_head", "value_embeds.weight"]
    params = dict(model.named_parameters())
    start = {n: params[n].detach().clone() for n in adam_names}
    sums = {n: torch.zeros_like(start[n]) for n in adam_names}
    for step in (0, 1):
        random_grads(model, gen, skip=("value_embeds.weight",))
        g_ve = torch.randn(ve.shape, generator=gen)
        buffer.add_(g_ve)
        sums["value_embeds.weight"] += g_ve
        for n in adam_names[:3]:
            sums[n] = params[n].grad.clone()  # .grad accumulates across the two steps
        plan_step(opt, step, lr_scale=1.0)
        if step == 0:
            for n in adam_names:
                assert torch.equal(params[n], start[n]), f"{n} moved on an even step"
            assert params["scalars"].grad is not None and params["qk_bank"].grad is None
            assert buffer.abs().sum() > 0
    assert buffer.abs().sum() == 0, "grad buffer not consumed"
    assert params["scalars"].grad is None
    for n in adam_names:
        c = opt.param_cfgs[params[n]]
        lr = 0.01 * c.lr_mul
        ref = adam_reference(start[n].to(F64), [sums[n].to(F64)], c.betas, 1e-10, lr,
                             lr * lr * 0.005 * c.wd_mul)
        torch.testing.assert_close(params[n].detach(), ref.float(), rtol=1e-5, atol=1e-6)


def test_tied_embed_head_and_untie():
    model = Tiny()
    opt = AnvilAndAdam(cfgs_of(model), AnvilConfig(),
                       tied_embed_head=(model.embed.weight, model.lm_head))
    gen = torch.Generator().manual_seed(10)
    head0 = model.lm_head.detach().clone()
    random_grads(model, gen)
    plan_step(opt, 0, 1.0)
    random_grads(model, gen)  # both .grads now hold two steps' sums
    total = model.lm_head.grad + model.embed.weight.grad.T  # what lm_head must be updated with
    plan_step(opt, 1, 1.0)
    torch.testing.assert_close(model.embed.weight.detach(), model.lm_head.detach().T)
    c = opt.param_cfgs[model.lm_head]
    ref = adam_reference(head0.to(F64), [total.to(F64)], c.betas, 1e-10, 0.008,
                         0.008 ** 2 * 0.005 * 150)
    torch.testing.assert_close(model.lm_head.detach(), ref.float(), rtol=1e-5, atol=1e-6)
    head_state = opt.adam_by_param[model.lm_head]
    embed_state = opt.adam_by_param[model.embed.weight]
    assert embed_state.exp_avg.abs().sum() == 0
    ptr = embed_state.exp_avg.data_ptr()
    opt.untie_embed_head()
    torch.testing.assert_close(embed_state.exp_avg, head_state.exp_avg.T)
    torch.testing.assert_close(embed_state.exp_avg_sq, head_state.exp_avg_sq.T)
    assert embed_state.exp_avg.data_ptr() == ptr and opt.tied is None
    random_grads(model, gen)
    plan_step(opt, 2, 1.0)
    random_grads(model, gen)
    plan_step(opt, 3, 1.0)
    assert not torch.equal(model.embed.weight.detach(), model.lm_head.detach().T)


def test_embed_grad_buffer_tied_and_untied_matches_dense_grad():
    """TrainConfig.embed_grad "pull": embed's gradient arrives in a float32 buffer instead of
    .grad. Tied, the buffer is added into lm_head's gradient and zeroed; untied, embed's own Adam
    step consumes and zeroes it; the parameters follow the dense-gradient run step for step."""
    dense_model, pull_model = Tiny(), Tiny()
    opts = [AnvilAndAdam(cfgs_of(m), AnvilConfig(), tied_embed_head=(m.embed.weight, m.lm_head))
            for m in (dense_model, pull_model)]
    buffer = torch.zeros_like(pull_model.embed.weight)
    opts[1].set_grad_buffer(pull_model.embed.weight, buffer)
    gen = torch.Generator().manual_seed(11)
    for step in range(4):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in dense_model.named_parameters()}
        for model in (dense_model, pull_model):
            for n, p in model.named_parameters():
                if model is pull_model and n == "embed.weight":
                    buffer.add_(grads[n])
                else:
                    p.grad = grads[n].clone() if p.grad is None else p.grad + grads[n]
        for opt in opts:
            plan_step(opt, step, 1.0)
        if step % 2 == 1:  # an Adam step consumed the buffer (tied at step 1, untied at 3)
            assert buffer.abs().sum() == 0, f"step {step}: the embed gradient buffer not zeroed"
        else:
            assert buffer.abs().sum() > 0
        if step == 1:
            for opt in opts:
                opt.untie_embed_head()
        for (n, pd), pp in zip(dense_model.named_parameters(), pull_model.parameters()):
            torch.testing.assert_close(pp.detach(), pd.detach(), msg=f"step {step}: {n}")
    assert not torch.equal(pull_model.embed.weight.detach(), pull_model.lm_head.detach().T)


def run_steps(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for step in steps:
        random_grads(model, gen)
        plan_step(opt, step, 1.0)


def test_state_dict_round_trip_and_reset_in_place():
    model = Tiny()
    opt = make_opt(model)
    # checkpoint after an Adam (odd) step: the even step's kept .grad is not optimizer state
    run_steps(model, opt, range(4), seed=11)
    saved_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd = opt.state_dict()
    saved_sd = {sec: {n: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in d.items()}
                      for n, d in sd[sec].items()} for sec in ("banks", "adam")}
    saved_sd.update({k: sd[k] for k in ("format", "rank", "world_size", "adam_steps", "tied")})
    run_steps(model, opt, range(4, 8), seed=12)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    ptrs = [t.data_ptr() for _, t in opt.named_state_tensors()]
    # reset: state zeroed in place, nothing reallocated
    opt.reset()
    assert [t.data_ptr() for _, t in opt.named_state_tensors()] == ptrs
    assert all(t.abs().sum() == 0 for role, t in opt.named_state_tensors()
               if role.rsplit(".", 1)[1] in ("momentum", "second_moment", "exp_avg", "exp_avg_sq"))
    assert opt.adam_steps == 0
    # round trip: restore params + optimizer state, replay steps 4..7
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved_params[n])
    opt.load_state_dict(saved_sd)
    assert [t.data_ptr() for _, t in opt.named_state_tensors()] == ptrs
    run_steps(model, opt, range(4, 8), seed=12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), after[n], rtol=0, atol=0)
    with pytest.raises(ValueError, match="rank"):
        opt.load_state_dict({**saved_sd, "world_size": 2})


def test_reset_reproduces_a_fresh_optimizer():
    model, twin = Tiny(), Tiny()
    opt = make_opt(model)
    run_steps(model, opt, range(4), seed=13)
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters()):
            p.copy_(q)
    opt.reset()
    run_steps(model, opt, range(4), seed=14)
    run_steps(twin, make_opt(twin), range(4), seed=14)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_bf16_params_keep_fp32_master():
    model = Tiny(dtype=torch.bfloat16)
    opt = make_opt(model)
    run_steps(model, opt, range(4), seed=15)
    bank = opt.banks[0]
    assert bank.master.dtype == torch.float32 and bank.param.dtype == torch.bfloat16
    torch.testing.assert_close(bank.shard, bank.master.to(torch.bfloat16), rtol=0, atol=0)
    assert not torch.equal(bank.master, bank.shard.float())  # the master holds the extra bits


# ---- config, table ----

@pytest.mark.parametrize("kw, field", [
    (dict(lr=0.0), "lr"), (dict(adam_lr=-1.0), "adam_lr"), (dict(adam_eps=0.0), "adam_eps"),
    (dict(weight_decay=-1.0), "weight_decay"), (dict(beta2=1.0), "beta2"),
    (dict(ns_steps=0), "ns_steps"), (dict(ortho_dtype="fp8"), "ortho_dtype"),
    (dict(adam_weight_decay=-0.1), "adam_weight_decay"),
])
def test_anvil_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        AnvilConfig(**kw)


@pytest.mark.parametrize("kw, field", [
    (dict(optim="sgd"), "optim"), (dict(optim="adam", comm="ring"), "comm"),
    (dict(optim="adam", betas=(0.9, 1.0)), "betas"), (dict(optim="adam", lr_mul=0.0), "lr_mul"),
    (dict(optim="adam", slot_lr_muls=(1.0, 2.0)), "slot_lr_muls"),
])
def test_param_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        ParamConfig(**kw)


def test_param_table():
    model = Tiny()
    cfgs = {n: cfgs_of(model)[p] for n, p in model.named_parameters()}
    assert cfgs["mlp_bank"].slot_lr_muls == (1.0, 2.0) and cfgs["qk_bank"].optim == "anvil"
    assert cfgs["embed.weight"].comm == "sharded" and cfgs["embed.weight"].wd_mul == 150
    assert cfgs["value_embeds.weight"].lr_mul == 75 and cfgs["value_embeds.weight"].betas == (0.75, 0.95)
    assert cfgs["scalars"].lr_mul == 5 and cfgs["smear_gate"].lr_mul == 0.01
    compiled_names = [("_orig_mod.blocks.0.resid_lambdas", nn.Parameter(torch.zeros(2)))]
    assert build_param_cfgs(compiled_names)[compiled_names[0][1]].betas == (0.9, 0.95)
    with pytest.raises(ValueError, match="mystery_weight"):
        build_param_cfgs([("mystery_weight", nn.Parameter(torch.zeros(2)))], PARAM_TABLE)
    with pytest.raises(ValueError, match="qk_bank"):
        build_param_cfgs([("qk_bank", nn.Parameter(torch.zeros(2, 2)))])

