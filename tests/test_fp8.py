"""fp8 matmuls on the CPU: quantisation helpers, the slow references against float32 matmuls, the
custom ops (t1s::fp8_mm, t1s::fp8_mm_backward) against the references, their fake registrations
(torch.library.opcheck), the op bodies against the CUDA layout rules of torch._scaled_mm (run on
fake CUDA tensors: torch's CUDA meta function checks row-/column-major operands and multiples of 16),
Fp8Matmuls.resolve / matmul / reset, and torch.compile(fullgraph=True) over the op and over the tiny
GPT with fp8 forced on.

Hardware: CPU. torch 2.13's CPU build runs torch._scaled_mm with float8 operands (it ignores layouts
and fast accumulation), so the op runs for real here; what needs a GPU (cuBLASLt, fast
accumulation, CUDA-graph capture, inductor) is in tests/test_fp8_gpu.py.
Run: `.venv/bin/python -m pytest tests/test_fp8.py -q` (~20 s).

Legend: T tokens, K inner dim, N output dim.
"""

import math
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.test_model import SMALL_VOCAB, _batch, _fcfg, _model
from track_1_short.model import fp8
from track_1_short.model.fp8 import (E4M3, E5M2, FP8_MAX, Fp8Config, Fp8Matmuls, amax_scale,
                                     dequantise, fp8_matmul, fp8_matmul_backward_reference,
                                     fp8_matmul_reference, quantise)

# Relative Frobenius error of the fp8 math against the float32 matmul of the unquantised operands.
# Round-to-nearest with m mantissa bits has relative error uniform in +-2^-(m+1) of the value's
# binade, std ~2.5% for e4m3 (m=3, measured 2.6%) and ~5% for e5m2 (m=2). The forward multiplies two
# e4m3 operands (~sqrt(2) x 2.6% = 3.7%, measured 3.7% at T, K, N = 64, 128, 256 and at the GPU
# shapes); the gradients combine e5m2 with e4m3 (measured 5.9%).
FWD_REL_TOL = 0.05
GRAD_REL_TOL = 0.08
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
MIN_SUBNORMAL_EXP = {E4M3: -9, E5M2: -16}


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _operands(site: str, t=64, k=128, n=256, seed=0):
    """(x [T, K], w [K, N], g [T, N]) shaped like the call site's data, in bf16."""
    g = torch.Generator().manual_seed(seed)
    if site == "lm_head":  # rms-normed activations, small head weights, logit gradients
        x = torch.randn(t, k, generator=g)
        x = x / x.square().mean(-1, keepdim=True).sqrt()
    else:  # relu(.)^2 activations: non-negative, heavy tailed
        x = torch.randn(t, k, generator=g).relu().square()
    w = torch.randn(k, n, generator=g) * 0.02
    grad = torch.randn(t, n, generator=g) * 0.01
    return x.bfloat16(), w.bfloat16(), grad.bfloat16()


def _site_scales(site: str, x, w):
    """(x_s, w_s, grad_s) as Fp8Matmuls uses them."""
    if site == "lm_head":
        return (torch.tensor(fp8.LM_HEAD_X_SCALE), torch.tensor(fp8.LM_HEAD_W_SCALE),
                torch.tensor(fp8.LM_HEAD_GRAD_SCALE))
    return amax_scale(x, E4M3), amax_scale(w, E4M3), None


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantise_round_trip_within_format_precision(dtype):
    scale = torch.tensor(0.37)
    fmax = FP8_MAX[dtype]
    v = torch.cat([torch.randn(4096) * 10.0 ** e for e in (-4, -2, 0, 2)]) * fmax * 0.37 / 300
    v = v[v.abs() < fmax * 0.37]  # in range: saturation is checked below
    q = quantise(v, scale, dtype)
    assert q.dtype == dtype and q.shape == v.shape
    err = (dequantise(q, scale) - v).abs()
    # half an ULP: relative 2^-(m+1) for normals, absolute half the smallest subnormal below them
    bound = v.abs() * 2.0 ** -(MANTISSA_BITS[dtype] + 1) + 0.37 * 2.0 ** (MIN_SUBNORMAL_EXP[dtype] - 1)
    assert (err <= bound * (1 + 1e-6)).all()
    big = quantise(torch.tensor([1e9, -1e9, float(fmax) * 0.37 * 1.001]), scale, dtype)
    assert dequantise(big, scale).tolist() == pytest.approx([fmax * 0.37, -fmax * 0.37, fmax * 0.37])


def test_quantise_keeps_strides_and_leaves_input_alone():
    x = torch.randn(32, 48)
    before = x.clone()
    q = quantise(x.t(), 0.5, E4M3)
    assert q.shape == (48, 32) and q.stride() == (1, 48)
    assert torch.equal(x, before)


def test_amax_scale_and_zero_tensors():
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    s = amax_scale(x, E4M3)
    assert s.dtype == torch.float32 and s.dim() == 0 and s.storage_offset() == 0
    assert s.item() == pytest.approx(x.float().abs().max().item() / 448.0, rel=1e-6)
    assert amax_scale(x, E5M2).item() == pytest.approx(x.float().abs().max().item() / 57344.0, rel=1e-6)
    zeros = torch.zeros(16, 32)
    q = quantise(zeros, amax_scale(zeros, E4M3), E4M3)
    assert torch.equal(q.float(), zeros)  # floored amax: no 0/0


@pytest.mark.parametrize("site", ["lm_head", "mlp_down"])
def test_reference_against_float32_matmul(site):
    x, w, g = _operands(site)
    x_s, w_s, grad_s = _site_scales(site, x, w)
    out = fp8_matmul_reference(x, w, x_s, w_s)
    assert out.dtype == torch.bfloat16 and out.shape == (64, 256)
    assert _rel(out, x.float() @ w.float()) < FWD_REL_TOL
    grad_x, grad_w = fp8_matmul_backward_reference(g, x, w, x_s, w_s, grad_s)
    assert grad_x.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
    assert _rel(grad_x, g.float() @ w.float().t()) < GRAD_REL_TOL
    assert _rel(grad_w, x.float().t() @ g.float()) < GRAD_REL_TOL


@pytest.mark.parametrize("site", ["lm_head", "mlp_down"])
def test_op_forward_backward_match_reference(site):
    """Same quantised operands on both sides, so only accumulation order and the final bf16
    rounding differ (CPU: equal to float rounding)."""
    x, w, g = _operands(site)
    x_s, w_s, grad_s = _site_scales(site, x, w)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_matmul(xl, wl, x_s, w_s, grad_s)
    out.backward(g)
    ref_x, ref_w = fp8_matmul_backward_reference(g, x, w, x_s, w_s, grad_s)
    assert out.dtype == torch.bfloat16 and _rel(out, fp8_matmul_reference(x, w, x_s, w_s)) < 1e-3
    assert xl.grad.dtype == torch.bfloat16 and _rel(xl.grad, ref_x) < 1e-3
    assert wl.grad.dtype == torch.bfloat16 and _rel(wl.grad, ref_w) < 1e-2  # fp32 -> bf16 cast


def test_opcheck_fake_and_autograd_registrations():
    """opcheck's schema and aot-dispatch tests compare/sum every tensor, which the CPU build cannot
    do for float8 (no sum/allclose kernels): they run where no fp8 tensor is compared (the backward
    op's aot-dispatch test: fp8 only as inputs); the compiled test below covers the rest."""
    x, w, g = _operands("mlp_down", t=32, k=32, n=48)
    x, w = x.requires_grad_(), w.requires_grad_()
    forward_tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    for site in ("lm_head", "mlp_down"):
        torch.library.opcheck(fp8._fp8_mm, (x, w, *_site_scales(site, x, w)), test_utils=forward_tests)
    x_s, w_s, _ = _site_scales("mlp_down", x, w)
    args = (g, quantise(x, x_s, E4M3), quantise(w, w_s, E4M3), x_s, w_s, None)
    torch.library.opcheck(fp8._fp8_mm_backward, args, test_utils=(
        "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("t,k,n", [(2048, 768, 50304), (2048, 3072, 768)])
def test_op_bodies_meet_cuda_scaled_mm_layout_rules(t, k, n):
    """The op bodies on fake CUDA tensors: every _scaled_mm call passes torch's CUDA meta checks
    (first operand row-major, second column-major, dims multiples of 16), at the speedrun shapes
    (lm head, MLP down), also for a transposed weight view."""
    with FakeTensorMode():
        x = torch.empty(t, k, device="cuda", dtype=torch.bfloat16)
        s = torch.ones((), device="cuda")
        for w in (torch.empty(k, n, device="cuda", dtype=torch.bfloat16),
                  torch.empty(n, k, device="cuda", dtype=torch.bfloat16).t()):
            out, x8, w8 = fp8.fp8_mm_forward(x, w, s, amax_scale(w, E4M3), None)
            assert (out.shape, out.dtype, out.device.type) == ((t, n), torch.bfloat16, "cuda")
            assert x8.stride() == (k, 1) and w8.stride() == (n, 1)  # as the fake impl promises
            grad_x, grad_w = fp8.fp8_mm_backward(torch.empty(t, n, device="cuda", dtype=torch.bfloat16),
                                                 x8, w8, s, s, None)
            assert (grad_x.shape, grad_x.dtype) == ((t, k), torch.bfloat16)
            assert (grad_w.shape, grad_w.dtype) == ((k, n), torch.float32)
        # the check is live: a row-major second operand is refused
        with pytest.raises(RuntimeError, match="col_major"):
            torch._scaled_mm(x8, w8, s, s, out_dtype=torch.bfloat16)


def test_fp8_matmul_rejects_bad_shapes_and_offset_scales():
    s = torch.tensor(1.0)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_matmul(torch.randn(24, 32), torch.randn(32, 16), s, s)
    with pytest.raises(ValueError, match=r"x \[T, K\] @ w \[K, N\]"):
        fp8_matmul(torch.randn(32, 32), torch.randn(16, 16), s, s)
    with pytest.raises(ValueError, match="own storage"):
        fp8_matmul(torch.randn(32, 32), torch.randn(32, 16), torch.ones(2)[1], s)


def test_resolve_warns_when_enabled_but_unavailable(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # disabled: silent
        assert Fp8Matmuls(Fp8Config(enabled=False)).resolve(torch.device("cpu")) is False
        assert Fp8Matmuls(Fp8Config(enabled=False)).resolve(torch.device("cuda")) is False
    m = Fp8Matmuls(Fp8Config(enabled=True))
    with pytest.warns(UserWarning, match="cannot run on cpu: not a CUDA device"):
        assert m.resolve(torch.device("cpu")) is False
    assert m.active is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.warns(UserWarning, match=r"cuda.*compute capability 8\.0 < 8\.9"):
        assert m.resolve(torch.device("cuda")) is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match=r"after model\.to\(device\)"):
        m.resolve(torch.device("cuda"))  # available, but the scales are still on the CPU


def test_scale_buffers_own_storage_and_stable_across_reset():
    m = Fp8Matmuls(Fp8Config())
    buffers = dict(m.named_buffers())
    assert set(buffers) == {"lm_head_x_scale", "lm_head_w_scale", "lm_head_grad_scale"}
    for b in buffers.values():
        assert b.dtype == torch.float32 and b.dim() == 0
        assert b.storage_offset() == 0 and b.untyped_storage().nbytes() == 4
    ptrs = {n: b.data_ptr() for n, b in buffers.items()}
    for b in buffers.values():
        b.fill_(3.0)
    m.reset()
    assert {n: b.data_ptr() for n, b in m.named_buffers()} == ptrs
    assert m.lm_head_x_scale.item() == pytest.approx(100 / 448)
    assert m.lm_head_w_scale.item() == pytest.approx(1.6 / 448)
    assert m.lm_head_grad_scale.item() == pytest.approx(0.75 / 448)


def test_matmul_dispatch():
    x, w, _ = _operands("mlp_down", t=32, k=64, n=48)
    x, w = x.float(), w.float()
    m = Fp8Matmuls(Fp8Config())
    assert torch.equal(m.matmul(x, w, which="lm_head"), x @ w)
    with pytest.raises(ValueError, match="which='mlp_up'"):
        m.matmul(x, w, which="mlp_up")
    m.active = True  # CPU stand-in for a resolved CUDA device
    for site in ("lm_head", "mlp_down"):
        out = m.matmul(x, w, which=site)
        x_s, w_s, _ = _site_scales(site, x, w)
        assert out.dtype == torch.float32  # x's dtype
        assert _rel(out, fp8_matmul_reference(x, w, x_s, w_s)) < 1e-3


def test_compiled_op_fullgraph_equals_eager():
    """aot_eager: dynamo + AOTAutograd trace both call sites and their backward, no graph break."""
    m = Fp8Matmuls(Fp8Config(enabled=True))
    m.active = True

    def f(x, w1, w2):
        h = m.matmul(x, w1, which="lm_head").relu().square()  # [T, N]
        return m.matmul(h, w2, which="mlp_down").float().square().sum()

    x, w1, _ = _operands("lm_head", t=32, k=64, n=48)
    w2 = (torch.randn(48, 32) * 0.05).bfloat16()
    leaves = [t.requires_grad_() for t in (x, w1, w2)]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=False)
    results = []
    for fn in (compiled, f):
        loss = fn(*leaves)
        results.append([loss.detach(), *torch.autograd.grad(loss, leaves)])
    assert counter.frame_count == 1
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_tiny_gpt_fp8_forced_on_compiles_and_tracks_bf16_path():
    """The tiny GPT with fp8 forced on (CPU stand-in): fullgraph aot_eager compile of forward +
    backward, compiled loss equals eager, and the loss stays within 2e-2 (relative, per token) of
    the plain path (measured 0.4% with a live lm head at V=50304). eval_ce never uses fp8."""
    t, cap, weights = 64, 8, [1.0, 0.5]
    inputs, targets, cu = _batch(t, cap, 3, vocab=SMALL_VOCAB)
    losses = {}
    for active in (False, True):
        model = _model(vocab_size=SMALL_VOCAB)
        with torch.no_grad():
            model.lm_head.normal_(0, 0.2)  # logits that matter (init std 0.005 gives ~uniform)
        model.fp8.active = active
        slots = model.ngram_table.slots_for(inputs)
        loss = model(inputs, targets, cu, slots, _fcfg(weights, ws=(16, 48), max_len=32))
        loss.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses[active] = loss.detach()
        with torch.no_grad():
            ce = model.eval_ce(inputs, targets, cu, slots, 16, 48, 32)
        losses[("eval", active)] = ce
    assert _rel(losses[True], losses[False]) < 2e-2
    assert torch.equal(losses[("eval", True)], losses[("eval", False)])

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=counter)
    slots = model.ngram_table.slots_for(inputs)
    loss = compiled(inputs, targets, cu, slots, _fcfg(weights, ws=(16, 48), max_len=32))
    loss.sum().backward()
    assert counter.frame_count == 1
    assert torch.allclose(loss, losses[True], atol=1e-4)
    assert not math.isnan(loss.sum().item())
