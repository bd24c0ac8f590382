"""AnvilAndAdam's step functions and compiled path, one process, CPU.

Scope: anvil_math's step functions (anvil_bank_step_, adam_step_, adam_group_step_) against the
float64 references of tests/test_anvil_math.py over several steps (state carried, bf16 master
rounding, grad-buffer zeroing); the compiled optimizer (aot_eager backend: dynamo + AOTAutograd,
the graphs inductor would get) against the eager one over steps with changing lr and momentum,
the tie and the untie, with no recompile after each graph's first step; the inductor (C++) build of
the bank and Adam step functions and the tied fold and copy against eager (`slow`, ~50 s); StepValues; the compile default; the bank
shard arithmetic at world sizes 1, 2, 4, 8 on the speedrun's mlp_bank matrix count.
Hardware: CPU only (~45 s with the slow test). Run: `.venv/bin/python -m pytest tests/test_anvil_fused.py -q`.
GPU twin: tests/test_anvil_gpu.py.
"""

import math

import pytest
import torch

from tests.test_anvil_math import (F64, SPEEDRUN, Tiny, adam_reference, cfgs_of, compose_matrix,
                                   normuon_reference)
from track_1_short.optim import anvil_math
from track_1_short.optim.anvil import AnvilAndAdam
from track_1_short.optim.anvil_config import AnvilConfig, ParamConfig
from track_1_short.optim.polar_express import POLAR_EXPRESS_COEFFS
from track_1_short.optim.step_values import StepValues
from track_1_short.perf.compile_cache import graphs_compiled

BF16 = torch.bfloat16


def bank_reference(p, grads, steps, beta2=0.9):
    """float64 ANVIL on a bank [K, R, C] from zero state: steps = [(mu, lr_eff [K,1,1], wd_lr)]."""
    momentum = torch.zeros_like(p)
    red = (p.size(0), p.size(1), 1) if p.size(1) >= p.size(2) else (p.size(0), 1, p.size(2))
    ema = torch.zeros(red, dtype=F64)
    for g, (mu, lr_eff, wd_lr) in zip(grads, steps):
        momentum = mu * momentum + (1 - mu) * g
        v = torch.stack([compose_matrix(m) for m in (1 - mu) * g + mu * momentum])
        v, ema = normuon_reference(v, ema, beta2)
        p = p - ((v * p) >= 0) * p * wd_lr * lr_eff - lr_eff * v
    return p


@pytest.mark.parametrize("shape", [(3, 8, 16), (2, 12, 12), (3, 24, 8)])  # wide, square, tall
def test_bank_step_vs_float64_over_steps(shape):
    gen = torch.Generator().manual_seed(20)
    p0 = torch.randn(shape, generator=gen, dtype=F64) * 0.2
    grads = [torch.randn(shape, generator=gen, dtype=F64) for _ in range(3)]
    lr_mul = torch.tensor([1.0, 2.0, 0.5][:shape[0]]).view(-1, 1, 1)
    steps = [(0.85, 0.02), (0.9, 0.015), (0.95, 0.01)]  # (mu, lr): changing every step
    wd = 1.2
    momentum, target = torch.zeros(shape), p0.float()
    second = torch.zeros(shape[0], shape[1], 1) if shape[1] >= shape[2] else torch.zeros(shape[0], 1, shape[2])
    for g, (mu, lr) in zip(grads, steps):
        scalars = torch.tensor([mu, lr, wd * lr], dtype=torch.float32)
        anvil_math.anvil_bank_step_(g.float(), momentum, second, target, None, lr_mul, scalars, 0.9,
                                    torch.float32, POLAR_EXPRESS_COEFFS)
    ref = bank_reference(p0, grads, [(mu, lr_mul.to(F64) * lr, wd * lr) for mu, lr in steps])
    torch.testing.assert_close(target, ref.float(), rtol=1e-4, atol=1e-6)


def test_bank_step_rounds_the_master_into_the_bf16_shard():
    gen = torch.Generator().manual_seed(21)
    master = torch.randn(2, 16, 8, generator=gen)
    shard = master.to(BF16)
    grad = torch.randn(2, 16, 8, generator=gen).to(BF16)
    scalars = torch.tensor([0.9, 0.02, 0.024])
    anvil_math.anvil_bank_step_(grad, torch.zeros(2, 16, 8), torch.zeros(2, 16, 1), master, shard,
                                torch.ones(2, 1, 1), scalars, 0.9, torch.float32, POLAR_EXPRESS_COEFFS)
    assert torch.equal(shard, master.to(BF16)) and not torch.equal(master, shard.float())


def test_adam_step_vs_float64_with_master_and_buffer_zeroing():
    gen = torch.Generator().manual_seed(22)
    p0 = torch.randn(6, 5, generator=gen)
    grads = [torch.randn(6, 5, generator=gen) for _ in range(3)]
    betas, eps, lr, eff_wd = (0.75, 0.95), 1e-10, 0.01, 0.3
    master, out = p0.clone(), p0.to(BF16)
    m, v, buffer = torch.zeros(6, 5), torch.zeros(6, 5), torch.zeros(6, 5)
    for t, g in enumerate(grads, start=1):
        buffer.add_(g)
        step_size = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)
        hyper = torch.tensor([*betas, step_size, eff_wd], dtype=torch.float32)
        anvil_math.adam_step_(master, buffer, m, v, hyper, eps, out, True)
        assert buffer.abs().sum() == 0, "the consumed gradient buffer must be zeroed"
        assert torch.equal(out, master.to(BF16))
    ref = adam_reference(p0.to(F64), [g.to(F64) for g in grads], betas, eps, lr, eff_wd)
    torch.testing.assert_close(master, ref.float(), rtol=1e-5, atol=1e-6)


def test_adam_group_step_equals_one_call_per_parameter():
    gen = torch.Generator().manual_seed(23)
    shapes = [(3,), (), (2, 4)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    hypers = torch.tensor([[0.9, 0.99, 0.01, 0.0], [0.9, 0.95, 0.05, 1e-4], [0.5, 0.95, 0.002, 0.3]])
    twins = [p.clone() for p in params]
    state = [(torch.zeros(s), torch.zeros(s)) for s in shapes]
    twin_state = [(torch.zeros(s), torch.zeros(s)) for s in shapes]
    anvil_math.adam_group_step_(params, grads, [m for m, _ in state], [v for _, v in state], hypers,
                                1e-10, [None] * 3, [False] * 3)
    for i, p in enumerate(twins):
        anvil_math.adam_step_(p, grads[i], *twin_state[i], hypers[i], 1e-10, None, False)
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


# ---- the optimizer, compiled vs eager ----

def _grads(model, gen, buffer):
    """Random gradients on the model's device (a CUDA generator there: no host-to-device copy);
    value_embeds' into its fp32 grad buffer (as ValueEmbedPull's backward adds them)."""
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen, device=p.device)
        if name == "value_embeds.weight":
            buffer.add_(g)
            continue
        g = g.to(p.dtype)
        p.grad = g if p.grad is None else p.grad + g


def _run(model, opt, steps, seed, untie_after=None):
    """Steps with lr and momentum changing every step, Adam on the speedrun plan's adam_step;
    value_embeds through a grad buffer."""
    ve = model.value_embeds.weight
    buffer = opt.grad_buffers[ve]
    gen = torch.Generator(device=ve.device).manual_seed(seed)
    counts = []
    for step in steps:
        _grads(model, gen, buffer)
        opt.step(step, 1.0 - 0.05 * step, 0.85 + 0.01 * step, SPEEDRUN.plan(step).adam_step)
        if step == untie_after:
            opt.untie_embed_head()
        counts.append(graphs_compiled())
    return counts


def _opt(model, **kw):
    opt = AnvilAndAdam(cfgs_of(model), AnvilConfig(**kw), tied_embed_head=(model.embed.weight, model.lm_head),
                       names={p: n for n, p in model.named_parameters()})
    ve = model.value_embeds.weight  # fp32 buffer, as ValueEmbedPull.grad_accum
    opt.set_grad_buffer(ve, torch.zeros(ve.shape, device=ve.device))
    return opt


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_compiled_optimizer_matches_eager_without_recompiles(dtype):
    torch._dynamo.reset()
    eager_model, compiled_model = Tiny(dtype=dtype), Tiny(dtype=dtype)
    eager, compiled = _opt(eager_model, compile=False), _opt(compiled_model, compile=True,
                                                            compile_backend="aot_eager")
    assert (eager.compiled, compiled.compiled) == (False, True)
    ptrs = [t.data_ptr() for _, t in compiled.named_state_tensors()]
    _run(eager_model, eager, range(10), seed=24, untie_after=3)
    start = graphs_compiled()
    counts = _run(compiled_model, compiled, range(10), seed=24, untie_after=3)
    # graphs: step 0 the banks (wide qk and square vo differ, tall mlp), step 1 the Adam group,
    # lm_head, value_embeds and the tied fold and copy, step 5 (first Adam step after the untie)
    # embed; none after
    assert [c - start for c in counts] == [3, 8, 8, 8, 8, 9, 9, 9, 9, 9], counts
    assert [t.data_ptr() for _, t in compiled.named_state_tensors()] == ptrs
    for (name, p), q in zip(eager_model.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow  # ~50 s on 2 busy cores: four inductor C++ builds
def test_inductor_step_functions_match_eager():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(25)
    bank = [torch.randn(2, 24, 8, generator=gen).to(BF16), torch.zeros(2, 24, 8),
            torch.zeros(2, 24, 1), torch.randn(2, 24, 8, generator=gen), None]
    bank[4] = bank[3].to(BF16)
    table = [torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen), torch.zeros(5, 7),
             torch.zeros(5, 7), torch.tensor([0.5, 0.95, 0.01, 0.2]), 1e-10, None, True]
    for fn, args, extra in ((anvil_math.anvil_bank_step_, bank,
                             (torch.ones(2, 1, 1), torch.tensor([0.9, 0.02, 0.024]), 0.9,
                              torch.float32, POLAR_EXPRESS_COEFFS)),
                            (anvil_math.adam_step_, table, ()),
                            (anvil_math.fold_tied_grad_, [torch.randn(6, 9, generator=gen),
                                                          torch.randn(9, 6, generator=gen), True], ()),
                            (anvil_math.copy_transposed_, [torch.zeros(9, 6, dtype=BF16),
                                                           torch.randn(6, 9, generator=gen).to(BF16)], ())):
        twin = [a.clone() if torch.is_tensor(a) else a for a in args]
        compiled = torch.compile(fn, dynamic=False, fullgraph=True, backend="inductor")
        for _ in range(2):  # state carried: the second call reads the first one's moments
            fn(*twin, *extra)
            compiled(*args, *extra)
        for got, want in zip(args, twin):
            if torch.is_tensor(got):
                torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)


# ---- StepValues, compile default, shard arithmetic ----

def test_step_values_write_in_place():
    sv = StepValues(3, torch.device("cpu"))
    ptr = sv.values.data_ptr()
    sv.write([0.1, 2.0, 1e-10])
    sv.write([0.3, 4.0, 5e-9])
    assert sv.values.data_ptr() == ptr and sv.values.dtype == torch.float32
    assert sv.values.tolist() == torch.tensor([0.3, 4.0, 5e-9]).tolist()
    with pytest.raises(AssertionError, match="2 values for 3"):
        sv.write([1.0, 2.0])


def test_run_step_reads_only_the_written_values():
    """The device half takes every per-step value from step_values: the last values written before
    run_step are the ones used, and write + run_step + zero_grad equals step()."""
    model, twin = Tiny(), Tiny()
    opt, ref = _opt(model), _opt(twin)
    _run(twin, ref, range(2), seed=26)
    gen = torch.Generator().manual_seed(26)
    for step in range(2):
        _grads(model, gen, opt.grad_buffers[model.value_embeds.weight])
        adam_step = SPEEDRUN.plan(step).adam_step
        opt.write_step_values(3.0, 0.5, False)  # stale values (no Adam count), overwritten
        opt.write_step_values(1.0 - 0.05 * step, 0.85 + 0.01 * step, adam_step)
        opt.run_step(step, adam_step)
        opt.zero_grad(adam_step)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_compile_default_and_validation():
    assert _opt(Tiny()).compiled is False  # CPU parameters: off unless forced
    assert _opt(Tiny(), compile=True, compile_backend="aot_eager").compiled is True
    with pytest.raises(ValueError, match="compile_backend"):
        AnvilConfig(compile_backend="tensorrt")
    with pytest.raises(ValueError, match="AnvilConfig.compile"):
        AnvilConfig(compile="yes")


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_mlp_bank_shards_at_reference_world_sizes(world_size):
    """The speedrun's mlp_bank count (12 entries x 2 = 24 matrices) splits over 1-8 ranks, and each
    rank's lr_mul follows its matrices' global slot (c_proj 2x), also for an odd K (3 at W = 8).
    Built shard by shard with the rank fields set by hand: the arithmetic needs no process group."""
    bank = torch.nn.Parameter(torch.zeros(12, 2, 8, 4))  # tall like [F, D]: shape_mult sqrt(2)
    cfg = ParamConfig(optim="anvil", slot_lr_muls=(1.0, 2.0))
    opt = AnvilAndAdam.__new__(AnvilAndAdam)
    opt.cfg = AnvilConfig()
    lr_muls = []
    for rank in range(world_size):
        opt.world_size, opt.rank = world_size, rank
        shard = opt._bank(bank, "mlp_bank", cfg)
        assert shard.first == rank * 24 // world_size and shard.momentum.size(0) == 24 // world_size
        lr_muls += shard.lr_mul.flatten().tolist()
    assert lr_muls == pytest.approx([(1.0, 2.0)[i % 2] * math.sqrt(2) for i in range(24)])
