"""Kernel cases of track_1_short/kernels/softcap_ce.py in the Triton interpreter (CPU).

Scope: the fused op's loss, logit gradient and (dx, dw) against a float64 reference of the same
math (model/loss.py's training_loss on float64 softcapped logits of the same GEMM output), and
against model/loss.py's own float32 torch path; N in {1, 2, 3}, T not a multiple of anything,
V not a power of two and not a multiple of BLOCK_V, rows past T - N (tail validity), prefix ids
mixing -1 and valid ids, zero and nonzero MTP/prefix weights, random upstream gradients, float32
and bf16, the softmax exp on the MUFU or as the FMA polynomial (LaunchConfig.fma_exp_passes 0, 1,
2; the sigmoid as tanh; one pass with its row scale); torch.library.opcheck; torch.compile(fullgraph=True) equal to eager. The fp8 lm head
(kernels/softcap_ce_fp8.py): against model/fp8.py's slow references, its fullgraph trace, and its
backward (the gradient quantised by kernels/fp8_quantise.py) bitwise model/fp8.fp8_matmul_grads
of the logit gradient; the recompute schedule (kernels/fp8_logit_grad.py): the forward leaves the
logits and equals one pass's loss and row scale, the recomputed e5m2 gradient is the float64
gradient rounded (tails, zero weights, repeated target columns), opcheck. Each case prints its measured errors (run with -s to see them). The
interpreter runs the plain-math variant (fast_math's inline PTX cannot run there).

Not collected by the normal suite (the name does not match test_*.py): TRITON_INTERPRET=1 must be
set before triton is first imported, and must not leak into other tests, so
tests/test_softcap_ce.py runs this file in its own pytest process: a subset by node id in the
default run (its QUICK_CASES, ~30 s), every case under `-m slow`.
Hardware: CPU; ~1-3 s per kernel call in the interpreter, ~3-4 min in all on 2 cores.
Run: `TRITON_INTERPRET=1 PYTHONPATH=. .venv/bin/python -m pytest -s -q tests/softcap_ce_cases.py`.

Legend: T tokens, D model dim, V vocab, N MTP targets.
"""

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("tests/softcap_ce_cases.py needs TRITON_INTERPRET=1 set before triton is imported; "
                       "run it through tests/test_softcap_ce.py or as its docstring says")

import pytest  # noqa: E402
import torch  # noqa: E402

from track_1_short.kernels.softcap_ce import (LaunchConfig, interpreted, linear_softcap_ce,  # noqa: E402
                                              linear_softcap_ce_op)
from track_1_short.model.loss import (SOFTCAP_DIV, SOFTCAP_SCALE, SOFTCAP_SHIFT, softcap,  # noqa: E402
                                      training_loss)

# V = 397 with BLOCK_V = 128: three full chunks and a 13-column tail; 5 programs over T rows.
# fma_exp_passes: which softmax exps run the polynomial exp2 (0: none, 1: pass 2, 2: both).
SMALL = LaunchConfig(block_v=128, num_warps=4, programs_per_sm=5, fma_exp_passes=1)
SMALL_MUFU = LaunchConfig(block_v=128, num_warps=4, programs_per_sm=5, fma_exp_passes=0)
SMALL_FMA2 = LaunchConfig(block_v=128, num_warps=4, programs_per_sm=5, fma_exp_passes=2)
LARGE = LaunchConfig(block_v=512, num_warps=4, programs_per_sm=3, fma_exp_passes=2)
# the sigmoid as 1/2 + tanh / 2: the interpreter runs the identity in exact math (its constants;
# the GPU's tanh.approx is bounded in tests/test_softcap_ce_gpu.py)
SMALL_TANH = LaunchConfig(block_v=128, num_warps=4, programs_per_sm=5, fma_exp_passes=1, tanh_sigmoid=True)
# one pass: the gradient written up to a row scale (its exp on the MUFU; FMA with fma_exp_passes=2)
SMALL_ONE_PASS = LaunchConfig(block_v=128, num_warps=4, programs_per_sm=5, one_pass=True)
LARGE_ONE_PASS = LaunchConfig(block_v=512, num_warps=4, programs_per_sm=3, fma_exp_passes=2, one_pass=True)
# recompute (the fp8 head's): the forward writes nothing; kernels/fp8_logit_grad.py recomputes the
# gradient in the backward (its exp on the MUFU; on the FMA pipes with fma_exp_passes=2)
SMALL_RECOMPUTE = LaunchConfig(block_v=128, num_warps=4, programs_per_sm=5, one_pass=True, recompute=True)
LARGE_RECOMPUTE = LaunchConfig(block_v=512, num_warps=4, programs_per_sm=3, fma_exp_passes=2, one_pass=True,
                               recompute=True)


def _inputs(seed: int, t: int, d: int, v: int, n: int, dtype: torch.dtype, prefix_share: float = 0.6,
            weights: list[float] | None = None, prefix_weight: float = 0.25):
    """Fresh random inputs (never zeros): x [T, D], w [D, V] scaled so z spans the softcap's
    range, targets [T], prefix ids [T] (-1 on ~1 - prefix_share of tokens), MTP weights [N]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    w = (torch.randn(d, v, generator=g) * (6.0 / d ** 0.5)).to(dtype)
    targets = torch.randint(0, v, (t,), generator=g)
    prefix = torch.randint(0, v, (t,), generator=g)
    prefix[torch.rand(t, generator=g) >= prefix_share] = -1
    if weights is None:
        weights = (0.5 + torch.rand(n, generator=g)).tolist()
    upstream = torch.randn(t, generator=g)  # [T]: a non-uniform dloss_sum/dloss_t
    return (x, w, targets, torch.tensor(weights, dtype=torch.float32),
            torch.tensor(prefix_weight, dtype=torch.float32), prefix, upstream)


def _reference_float64(x, w, targets, mtp_weights, prefix_weight, prefix, upstream):
    """(loss [T], dz [T, V] for the upstream gradient, dx [T, D], dw [D, V]) in float64, from the
    same GEMM output z = x @ w the op rounds to x's dtype."""
    z = torch.mm(x, w).double().requires_grad_()  # [T, V]
    capped = SOFTCAP_SCALE * torch.sigmoid((z + SOFTCAP_SHIFT) / SOFTCAP_DIV)  # loss.softcap in float64
    loss = training_loss(capped, targets, mtp_weights.double(), prefix_weight.double(), prefix)
    (dz,) = torch.autograd.grad(loss, z, upstream.double())
    return loss.detach(), dz, dz @ w.double().T, x.double().T @ dz


def _fused(x, w, targets, mtp_weights, prefix_weight, prefix, upstream, launch):
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_softcap_ce(xl, wl, targets, mtp_weights, prefix_weight, prefix, launch=launch)
    loss.backward(upstream)
    return loss.detach(), xl.grad, wl.grad


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| (Frobenius), in float64."""
    return float((a.detach().double() - ref).norm() / ref.norm())


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|."""
    return float((a.detach().double() - ref).abs().max() / ref.abs().max())


def test_kernel_is_interpreted():
    assert interpreted(), "triton was imported before TRITON_INTERPRET=1 took effect"


# (dtype, N, T, V, launch, loss tolerance, gradient tolerance). float32: everything but the
# kernel's float32 math is exact, so errors are float32 rounding. bf16: the gradient is rounded to
# bf16 in the kernel (truncated in the interpreter, see below) and the backward GEMMs write bf16.
CASES = [
    (torch.float32, 1, 67, 397, SMALL, 1e-6, 1e-5),
    (torch.float32, 2, 67, 397, SMALL_MUFU, 1e-6, 1e-5),
    (torch.float32, 3, 67, 397, SMALL_FMA2, 1e-6, 1e-5),
    (torch.float32, 3, 67, 397, SMALL_TANH, 1e-6, 1e-5),
    (torch.float32, 3, 67, 397, SMALL_ONE_PASS, 1e-6, 1e-5),
    (torch.float32, 2, 67, 397, LARGE_ONE_PASS, 1e-6, 1e-5),
    (torch.bfloat16, 3, 130, 1000, LARGE_ONE_PASS, 1e-6, 1e-2),
    (torch.bfloat16, 3, 130, 1000, LARGE, 1e-6, 1e-2),
    (torch.bfloat16, 1, 64, 384, LARGE, 1e-6, 1e-2),
]
# stable test ids (tests/test_softcap_ce.py selects cases by id): dtype, N, T, V, the launch's name
# (looked up by identity: SMALL and SMALL_TANH are equal values, tanh_sigmoid being on by default)
LAUNCH_NAMES = ((SMALL, "small"), (SMALL_MUFU, "small_mufu"), (SMALL_FMA2, "small_fma2"),
                (SMALL_TANH, "small_tanh"), (SMALL_ONE_PASS, "small_one_pass"), (LARGE, "large"),
                (LARGE_ONE_PASS, "large_one_pass"))
CASE_IDS = [f"{str(dtype).removeprefix('torch.')}-N{n}-T{t}-V{v}-"
            + next(name for obj, name in LAUNCH_NAMES if obj is launch)
            for dtype, n, t, v, launch, *_ in CASES]


@pytest.mark.parametrize("dtype,n,t,v,launch,loss_tol,grad_tol", CASES, ids=CASE_IDS)
def test_loss_and_gradients_match_float64_reference(dtype, n, t, v, launch, loss_tol, grad_tol):
    args = _inputs(seed=1000 * n + t, t=t, d=32, v=v, n=n, dtype=dtype)
    loss_ref, _, dx_ref, dw_ref = _reference_float64(*args)
    loss, dx, dw = _fused(*args, launch=launch)
    assert loss.dtype == torch.float32 and dx.dtype == dtype and dw.dtype == dtype
    errs = {"loss_max": max_err(loss, loss_ref), "dx_rel": rel_err(dx, dx_ref), "dw_rel": rel_err(dw, dw_ref),
            "dx_max": max_err(dx, dx_ref), "dw_max": max_err(dw, dw_ref)}
    print(f"\n{dtype} N={n} T={t} V={v}: " + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()))
    assert errs["loss_max"] < loss_tol
    assert max(errs["dx_rel"], errs["dw_rel"]) < grad_tol
    assert max(errs["dx_max"], errs["dw_max"]) < 4 * grad_tol


# The interpreter's float32 -> bf16 cast truncates (triton 3.6 runtime/interpreter.py cast_impl);
# the GPU rounds to nearest. Bound per element: one bf16 ulp here (2^-7 relative), half an ulp on
# the GPU (tests/test_softcap_ce_gpu.py).
@pytest.mark.parametrize("one_pass", [False, True], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("dtype,ulp_rel", [(torch.float32, 2.0 ** -23), (torch.bfloat16, 2.0 ** -7)],
                         ids=["float32", "bfloat16"])
def test_logit_gradient_written_over_the_logits(dtype, ulp_rel, one_pass):
    """The raw op's dz (unit upstream gradient) times its row scale, element by element: within
    one ulp of dz's dtype plus float32 math, and the loss within float32 rounding; the row scale
    is 1 but with one_pass."""
    x, w, targets, mtp, pw, prefix, _ = _inputs(seed=7, t=70, d=32, v=397, n=3, dtype=dtype)
    loss, dz, scale = linear_softcap_ce_op(x, w, targets, mtp, pw, prefix, 128, 4, 5, False, 1, False,
                                           one_pass)
    loss_ref, dz_ref, _, _ = _reference_float64(x, w, targets, mtp, pw, prefix, torch.ones(70))
    assert dz.shape == (70, 397) and dz.dtype == dtype and scale.shape == (70,)
    assert torch.all(scale != 1.0) if one_pass else torch.all(scale == 1.0)
    grad = dz.double() * scale.double()[:, None]  # [T, V]
    # one ulp of the element, plus float32 math (cancellation near the targets) of 1e-6 of its row
    bound = dz_ref.abs() * ulp_rel + 1e-6 * dz_ref.abs().amax(1, keepdim=True)  # [T, V]
    excess = (grad - dz_ref).abs() / bound
    print(f"\n{dtype} one_pass={one_pass} dz: max {max_err(grad, dz_ref):.2e}, rel {rel_err(grad, dz_ref):.2e}, "
          f"worst element {float(excess.max()):.2f} of its bound")
    assert float(excess.max()) <= 1.0 and max_err(loss, loss_ref) < 1e-6


@pytest.mark.parametrize("launch", [SMALL, SMALL_ONE_PASS], ids=["two_pass", "one_pass"])
def test_tail_rows_zero_weights_and_missing_prefixes(launch):
    """Rows t >= T - 2 lose MTP terms; weight 0 turns a term off; a -1 prefix turns its term off
    (here all prefixes -1 but with a nonzero weight, and an MTP weight of 0)."""
    args = _inputs(seed=3, t=33, d=32, v=397, n=3, dtype=torch.float32, prefix_share=0.0,
                   weights=[1.0, 0.0, 0.5], prefix_weight=0.7)
    loss_ref, _, dx_ref, dw_ref = _reference_float64(*args)
    loss, dx, dw = _fused(*args, launch=launch)
    assert max_err(loss, loss_ref) < 1e-6
    assert rel_err(dx, dx_ref) < 1e-5 and rel_err(dw, dw_ref) < 1e-5
    x, w, targets, _, _, _, _ = args
    capped = softcap(torch.mm(x, w)).double()
    lse = torch.logsumexp(capped, -1)
    last = lse[-1] - capped[-1, targets[-1]]  # only k = 0 is valid in the last row
    assert float(loss[-1]) == pytest.approx(float(last), rel=1e-6)


@pytest.mark.parametrize("launch", [SMALL, SMALL_ONE_PASS], ids=["two_pass", "one_pass"])
def test_all_weights_zero_give_zero_loss_and_gradients(launch):
    args = _inputs(seed=4, t=40, d=32, v=397, n=2, dtype=torch.float32, weights=[0.0, 0.0],
                   prefix_weight=0.0)
    loss, dx, dw = _fused(*args, launch=launch)
    assert torch.count_nonzero(loss) == 0 and torch.count_nonzero(dx) == 0 and torch.count_nonzero(dw) == 0


def test_matches_the_float32_torch_path():
    """Against model/loss.py as GPT.forward runs it: training_loss(softcap(x @ w), ...), bf16."""
    x, w, targets, mtp, pw, prefix, upstream = _inputs(seed=5, t=96, d=32, v=1000, n=3,
                                                       dtype=torch.bfloat16)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = training_loss(softcap(xr @ wr), targets, mtp, pw, prefix)
    ref.backward(upstream)
    loss, dx, dw = _fused(x, w, targets, mtp, pw, prefix, upstream, launch=LARGE)
    errs = (max_err(loss, ref.detach().double()), rel_err(dx, xr.grad.double()),
            rel_err(dw, wr.grad.double()))
    print(f"\nvs torch path (bf16): loss max {errs[0]:.2e}, dx rel {errs[1]:.2e}, dw rel {errs[2]:.2e}")
    assert errs[0] < 1e-6 and max(errs[1:]) < 1e-2


@pytest.mark.parametrize("one_pass", [False, True], ids=["two_pass", "one_pass"])
def test_opcheck(one_pass):
    x, w, targets, mtp, pw, prefix, _ = _inputs(seed=6, t=17, d=8, v=100, n=2, dtype=torch.float32)
    args = (x.requires_grad_(), w.requires_grad_(), targets, mtp, pw, prefix, 64, 4, 2, False, 1,
            False, one_pass)
    torch.library.opcheck(linear_softcap_ce_op, args)


def test_compiled_fullgraph_equals_eager():
    x, w, targets, mtp, pw, prefix, upstream = _inputs(seed=8, t=50, d=32, v=397, n=3, dtype=torch.float32)

    def step(x, w, mtp, pw):
        return (linear_softcap_ce(x, w, targets, mtp, pw, prefix, launch=SMALL) * upstream).sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    grads = []
    for fn in (step, compiled):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xl, wl, mtp, pw)
        out.backward()
        grads.append((out.detach(), xl.grad, wl.grad))
    for a, b in zip(*grads):  # the same op; inductor may sum the [T] products in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # new weight values reach the compiled kernel (device tensors, not baked constants)
    doubled = compiled(x, w, mtp * 2, pw * 2)
    torch.testing.assert_close(doubled, 2 * grads[0][0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------ fp8 lm head (kernels/softcap_ce_fp8.py)

def _fp8_case(seed: int, t: int = 48, v: int = 400):
    """bf16 inputs at multiples of 16 (torch._scaled_mm), current-amax dequantisation scales for x
    and w, and a gradient scale from the reference logit gradient's amax."""
    from track_1_short.model.fp8 import E4M3, amax_scale

    x, w, targets, mtp, pw, prefix, upstream = _inputs(seed=seed, t=t, d=32, v=v, n=2, dtype=torch.bfloat16)
    return (x, w, targets, mtp, pw, prefix, upstream, amax_scale(x, E4M3), amax_scale(w, E4M3))


def _fp8_reference(x, w, targets, mtp, pw, prefix, upstream, x_s, w_s, grad_s):
    """(loss [T], dx [T, D], dw [D, V]) from model/fp8.py's slow references around model/loss.py:
    logits of the fake-quantised operands rounded to bf16 (the GEMM's output dtype), the float64
    logit gradient for the upstream gradient, then the fp8 backward reference on it."""
    from track_1_short.model.fp8 import fp8_matmul_backward_reference, fp8_matmul_reference

    z = fp8_matmul_reference(x, w, x_s, w_s).to(torch.bfloat16).double().requires_grad_()  # [T, V]
    capped = SOFTCAP_SCALE * torch.sigmoid((z + SOFTCAP_SHIFT) / SOFTCAP_DIV)
    loss = training_loss(capped, targets, mtp.double(), pw.double(), prefix)
    (dz,) = torch.autograd.grad(loss, z, upstream.double())
    dx, dw = fp8_matmul_backward_reference(dz.float(), x, w, x_s, w_s, grad_s)
    return loss.detach(), dx, dw


def _fp8_fused(x, w, targets, mtp, pw, prefix, upstream, x_s, w_s, grad_s, fn=None, launch=LARGE):
    from track_1_short.kernels.softcap_ce_fp8 import linear_softcap_ce_fp8

    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    run = fn or (lambda x, w: linear_softcap_ce_fp8(x, w, targets, mtp, pw, prefix, x_s=x_s, w_s=w_s,
                                                     grad_s=grad_s, launch=launch))
    loss = run(xl, wl)
    loss.backward(upstream)
    return loss.detach(), xl.grad, wl.grad


@pytest.mark.parametrize("launch", [LARGE, LARGE_ONE_PASS, LARGE_RECOMPUTE],
                         ids=["two_pass", "one_pass", "recompute"])
def test_fp8_head_matches_the_fp8_reference(launch):
    """The fp8 fused head against model/fp8.py's references around the torch loss: the loss equals
    it up to float32 rounding (the same fp8 operands); the gradients differ only where the bf16
    rounding of dz moves an element across an e5m2 rounding boundary (2 mantissa bits: a flip is
    a 2^-3 relative change of that element), measured here at ~1e-3 relative overall."""
    from track_1_short.model.fp8 import E5M2, amax_scale

    x, w, targets, mtp, pw, prefix, upstream, x_s, w_s = _fp8_case(seed=11)
    _, dz64, dx64, _ = _reference_float64(x, w, targets, mtp, pw, prefix, upstream)  # bf16 GEMMs
    grad_s = amax_scale(dz64.float(), E5M2)  # the logit gradient over the e5m2 range
    loss_ref, dx_ref, dw_ref = _fp8_reference(x, w, targets, mtp, pw, prefix, upstream, x_s, w_s, grad_s)
    loss, dx, dw = _fp8_fused(x, w, targets, mtp, pw, prefix, upstream, x_s, w_s, grad_s, launch=launch)
    assert loss.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    errs = {"loss_max": max_err(loss, loss_ref.double()), "dx_rel": rel_err(dx, dx_ref.double()),
            "dw_rel": rel_err(dw, dw_ref.double()), "dx_rel_vs_bf16": rel_err(dx, dx64)}
    print("\nfp8 head vs fp8 reference: " + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()))
    assert errs["loss_max"] < 1e-5 and max(errs["dx_rel"], errs["dw_rel"]) < 2e-2
    # and the op does run in fp8: against the bf16 GEMMs' gradient it is several times coarser
    assert errs["dx_rel_vs_bf16"] > 2 * errs["dx_rel"]


@pytest.mark.parametrize("launch", [LARGE, LARGE_RECOMPUTE], ids=["two_pass", "recompute"])
def test_fp8_head_traces_as_one_graph(launch):
    """dynamo + AOTAutograd (fullgraph, aot_eager: the graph the inductor path starts from) take
    the autograd.Function with its custom ops and equal eager."""
    from track_1_short.kernels.softcap_ce_fp8 import linear_softcap_ce_fp8
    from track_1_short.model.fp8 import LM_HEAD_GRAD_SCALE

    x, w, targets, mtp, pw, prefix, upstream, x_s, w_s = _fp8_case(seed=12, t=32, v=160)
    grad_s = torch.tensor(LM_HEAD_GRAD_SCALE)

    def head(x, w):
        return linear_softcap_ce_fp8(x, w, targets, mtp, pw, prefix, x_s=x_s, w_s=w_s, grad_s=grad_s,
                                     launch=launch)

    eager = _fp8_fused(x, w, targets, mtp, pw, prefix, upstream, x_s, w_s, grad_s, fn=head)
    compiled = _fp8_fused(x, w, targets, mtp, pw, prefix, upstream, x_s, w_s, grad_s,
                          fn=torch.compile(head, fullgraph=True, dynamic=False, backend="aot_eager"))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("launch", [LARGE, LARGE_ONE_PASS], ids=["two_pass", "one_pass"])
def test_fp8_head_backward_is_fp8_matmuls_backward_of_the_logit_gradient(launch):
    """The backward's fused quantisation (kernels/fp8_quantise.py) changes nothing: dx and dw are
    BITWISE model/fp8.fp8_matmul_grads of the graph-code logit gradient dz * (g * r)[:, None], from
    the raw forward op's dz and row scale r and the same e4m3 operands."""
    from track_1_short.kernels.softcap_ce_fp8 import softcap_ce_fp8_fwd
    from track_1_short.model.fp8 import (E5M2, amax_scale, col_major, fp8_matmul_grads,
                                         quantise_operands, row_major)

    x, w, targets, mtp, pw, prefix, upstream, x_s, w_s = _fp8_case(seed=13)
    x8, w8 = quantise_operands(x, w, x_s, w_s)
    _, dz, scale = softcap_ce_fp8_fwd(row_major(x8), col_major(w8), x_s, w_s, targets, mtp, pw, prefix,
                                      *launch.op_args())
    # the two-pass kernel writes the whole gradient (a unit row scale), the one-pass one does not
    assert torch.all(scale != 1.0) if launch.one_pass else torch.all(scale == 1.0)
    gz = dz * (upstream * scale)[:, None]  # [T, V] float32, what the backward quantised before the kernel
    grad_s = amax_scale(gz, E5M2)
    dx_ref, dw_ref = fp8_matmul_grads(gz, grad_s, col_major(x8), row_major(w8), x_s, w_s,
                                      (torch.bfloat16, torch.bfloat16))
    _, dx, dw = _fp8_fused(x, w, targets, mtp, pw, prefix, upstream, x_s, w_s, grad_s, launch=launch)
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref)


# ------------------------------------------------ recompute (kernels/fp8_logit_grad.py)

def _logit_case(seed: int, t: int, v: int, n: int, weights: list[float], prefix_weight: float):
    """bf16 logits z [T, V] spanning the softcap's range, targets with some repeated as the prefix
    (one column named by two slots), -1 prefixes, an upstream gradient g [T]."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(t, v, generator=g) * 6).to(torch.bfloat16)
    targets = torch.randint(0, v, (t,), generator=g)
    prefix = torch.randint(0, v, (t,), generator=g)
    prefix[::3] = -1
    prefix[1::5] = targets[1::5]
    return (z, targets, prefix, torch.tensor(weights, dtype=torch.float32),
            torch.tensor(prefix_weight, dtype=torch.float32), torch.randn(t, generator=g))


@pytest.mark.parametrize("launch", [SMALL_RECOMPUTE, LARGE_RECOMPUTE], ids=["mufu_exp", "fma_exp"])
def test_recompute_forward_leaves_the_logits_and_equals_one_pass(launch):
    """The recompute forward writes no gradient (z unchanged) and returns one pass's loss and row
    scale bitwise (the same kernel without its stores)."""
    from track_1_short.kernels.softcap_ce import softcap_ce_rows_

    z, targets, prefix, mtp, pw, _ = _logit_case(21, t=37, v=397, n=3, weights=[1.0, 0.5, 0.25],
                                                 prefix_weight=0.3)
    kept = z.clone()
    loss, scale = softcap_ce_rows_(kept, targets, mtp, pw, prefix, launch)
    assert torch.equal(kept, z)
    one = z.clone()
    loss_one, scale_one = softcap_ce_rows_(one, targets, mtp, pw, prefix,
                                           LaunchConfig(**{**_fields(launch), "recompute": False}))
    assert not torch.equal(one, z)  # the one-pass kernel did write its gradient
    assert torch.equal(loss, loss_one) and torch.equal(scale, scale_one)


def _fields(launch: LaunchConfig) -> dict:
    return dict(zip(("block_v", "num_warps", "programs_per_sm", "fast_math", "fma_exp_passes",
                     "tanh_sigmoid", "one_pass", "recompute"), launch.op_args(), strict=True))


# (N, T, V, MTP weights, prefix weight): tails past T - N, an MTP weight of 0, rows whose weights
# are all 0 (the second case: no prefix term and one target); V not a multiple of the tile
RECOMPUTE_CASES = [(3, 37, 397, [1.0, 0.0, 0.25], 0.3), (1, 29, 300, [0.0], 0.0), (2, 64, 256, [1.0, 0.5], 0.25)]


@pytest.mark.parametrize("n,t,v,weights,prefix_weight", RECOMPUTE_CASES)
def test_recomputed_fp8_gradient_is_the_exact_gradient_rounded(n, t, v, weights, prefix_weight):
    """fp8_logit_grad from the recompute forward's row scale: every element of row (and col, its
    column-major copy) is e5m2 of the float64 gradient g dloss/dz / grad_s, except where that
    value lies within 1e-5 relative of an e5m2 rounding boundary (float32 math may round it
    either way); the target slots' columns (the fix-up) included."""
    from track_1_short.kernels.fp8_logit_grad import fp8_logit_grad
    from track_1_short.kernels.softcap_ce import softcap_ce_rows_
    from track_1_short.model.fp8 import E5M2

    z, targets, prefix, mtp, pw, g = _logit_case(22 + t, t=t, v=v, n=n, weights=weights,
                                                 prefix_weight=prefix_weight)
    _, scale = softcap_ce_rows_(z.clone(), targets, mtp, pw, prefix, SMALL_RECOMPUTE)
    zz = z.double().requires_grad_()
    capped = SOFTCAP_SCALE * torch.sigmoid((zz + SOFTCAP_SHIFT) / SOFTCAP_DIV)
    (dz,) = torch.autograd.grad(training_loss(capped, targets, mtp.double(), pw.double(), prefix), zz,
                                g.double())
    grad_s = torch.tensor(max(float(dz.abs().max()), 1e-3) / 40000.0)  # the largest element near e5m2's top
    row, col = fp8_logit_grad(z, g * scale, g, targets, prefix, mtp, pw, grad_s, SMALL_RECOMPUTE)
    assert row.dtype == col.dtype == E5M2 and row.stride() == (v, 1) and col.stride() == (1, t)
    y = dz / float(grad_s)
    # compared as values: +0 and -0 are one gradient (0 times a negative g is -0)
    lo, hi = ((y * (1 + d)).float().to(E5M2).float() for d in (-1e-5, 1e-5))
    sure = lo == hi  # [T, V]: the rounding is decided
    got = row.float()
    wrong = (got != lo) & sure
    # the one-hot columns, where the fix-up writes
    cols = torch.zeros(t, v, dtype=torch.bool)
    for k in range(n):
        rows = torch.arange(t - k)
        cols[rows, targets[rows + k]] = True
    cols[prefix >= 0, prefix[prefix >= 0]] = True
    print(f"\nrecompute N={n} T={t} V={v}: {int(wrong.sum())} wrong, {int((~sure).sum())} undecided of "
          f"{t * v}; target columns {int(cols.sum())}")
    assert int(wrong.sum()) == 0 and int((~sure).sum()) < t * v // 1000 + 2
    assert torch.equal(col.view(torch.uint8), row.view(torch.uint8))  # the same bytes in the other layout
    assert torch.equal(got[cols], lo[cols])  # the fix-up's columns (decided there in these cases)
    if not any(weights) and prefix_weight == 0.0:
        assert not got.any()  # W = 0 everywhere: a zero gradient (not NaN)


def test_fp8_logit_grad_opcheck():
    from track_1_short.kernels.fp8_logit_grad import fp8_logit_grad_op

    z, targets, prefix, mtp, pw, g = _logit_case(31, t=17, v=100, n=2, weights=[1.0, 0.5], prefix_weight=0.25)
    h = g * 0.01
    torch.library.opcheck(fp8_logit_grad_op, (z, h, g, targets, prefix, mtp, pw, torch.tensor(1e-4),
                                              False, False, False, 16, 32, 4, True))


def test_recompute_backward_takes_an_expanded_upstream_gradient():
    """loss.sum().backward() hands the backward an expanded (stride-0) upstream gradient: the
    recompute head's gradients equal those of the same ones given as a contiguous tensor (its
    kernels read g and h by row)."""
    from track_1_short.kernels.softcap_ce_fp8 import linear_softcap_ce_fp8
    from track_1_short.model.fp8 import LM_HEAD_GRAD_SCALE

    x, w, targets, mtp, pw, prefix, _, x_s, w_s = _fp8_case(seed=14, t=32, v=160)
    grad_s = torch.tensor(LM_HEAD_GRAD_SCALE)
    grads = []
    for expanded in (True, False):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_softcap_ce_fp8(xl, wl, targets, mtp, pw, prefix, x_s=x_s, w_s=w_s, grad_s=grad_s,
                                     launch=LARGE_RECOMPUTE)
        if expanded:
            loss.sum().backward()
        else:
            loss.backward(torch.ones(loss.shape[0]))
        grads.append((xl.grad, wl.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert grads[0][0].abs().sum() > 0
