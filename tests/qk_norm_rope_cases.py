"""Kernel cases of track_1_short/kernels/qk_norm_rope.py in the Triton interpreter (CPU).

Scope: the fused q/k rms-norm + RoPE against the model's torch path (model/gpt.norm_rotate: rms_norm,
then Yarn.rotate, or on a paired layer Yarn.rotate_doubled(pair_heads(.))),
forward values and the gradient of qk, unpaired and paired, float32 and bfloat16, after a YaRN
window change, at a head-row count that is not a multiple of the kernel's row block; the
tables' stationary half left unread; the whole
tiny GPT (four heads: loss and every gradient) with the kernel installed against without; the
op under torch.compile(fullgraph) with its backward graph read (q's and k's gradients handed over as
they are); a gradient through q alone; and the input errors.

Not collected by the normal suite (the name does not match test_*.py): TRITON_INTERPRET=1 must be
set before triton is first imported, so tests/test_qk_norm_rope.py runs this file in its own
process. Hardware: CPU, ~1 min.
Run: `TRITON_INTERPRET=1 PYTHONPATH=. .venv/bin/python -m pytest -q tests/qk_norm_rope_cases.py`.

Legend: T tokens, H heads, D head_dim.
"""

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("tests/qk_norm_rope_cases.py needs TRITON_INTERPRET=1 set before triton is "
                       "imported; run it through tests/test_qk_norm_rope.py or as its docstring says")

import pytest  # noqa: E402
import torch  # noqa: E402

from track_1_short.kernels import qk_norm_rope as kernel_module  # noqa: E402
from track_1_short.kernels.qk_norm_rope import Tiling, interpreted, qk_norm_rope  # noqa: E402
from track_1_short.model.gpt import norm_rotate  # noqa: E402
from track_1_short.model.yarn import Yarn  # noqa: E402
from tests.test_model import _batch, _fcfg, _model, _slots  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _fused(qk, yarn, paired):
    return qk_norm_rope(qk, *yarn.head_tables(), paired)


def test_the_interpreter_runs_the_kernels():
    assert interpreted()


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradient_equal_the_torch_path(paired, dtype):
    torch.manual_seed(0)
    t, h, d = 13, 6, 32  # 78 head rows per output: not a multiple of the row block
    assert (t * h) % Tiling().block_rows
    yarn = Yarn(head_dim=d, max_position=64, paired=paired)
    yarn.extend_window(16, 48)  # a YaRN-moved table, not the initial one
    qk = (torch.randn(t, 2, h, d) * 3).to(dtype)
    gq, gk = (torch.randn(2 * t if paired else t, h // 2 if paired else h, d).to(dtype) for _ in range(2))
    outs, grads = [], []
    for fn in (norm_rotate, _fused):
        x = qk.clone().requires_grad_(True)
        q, k = fn(x, yarn, paired)
        ((q.float() * gq.float()).sum() + (k.float() * gk.float()).sum()).backward()
        outs.append((q.detach(), k.detach()))
        grads.append(x.grad)
    for ref, got in zip(outs[0], outs[1]):
        assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
        assert torch.allclose(got.float(), ref.float(), **TOL[dtype])
    assert torch.allclose(grads[1].float(), grads[0].float(), **TOL[dtype])
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("tiling", [Tiling(block_rows=1, num_warps=1), Tiling(block_rows=8),
                                    Tiling(block_rows=64, num_warps=8)])
def test_every_tiling_computes_the_same_rows(paired, tiling):
    """Forward and backward at other launch shapes (one row per program; a partial last block;
    more rows per program than there are) equal the default tiling bit for bit: a row's math
    does not depend on its program, so any indexing slip shows as a difference."""
    torch.manual_seed(1)
    t, h, d = 11, 6, 16
    yarn = Yarn(head_dim=d, max_position=32, paired=paired)
    cos, sin = yarn.head_tables()
    qk = torch.randn(t, 2, h, d)
    gq, gk = torch.randn(2, t * h, d)
    runs = []
    for launch in (Tiling(), tiling):
        q, k, rstd = kernel_module._qk_norm_rope_fake(qk, cos, sin, paired)
        for z in (q, k, rstd):
            z.fill_(float("nan"))  # a row no program writes stays NaN
        kernel_module.forward_into(qk, cos, sin, paired, q, k, rstd, launch)
        dqk = torch.full_like(qk, float("nan"))
        kernel_module.backward_into(gq, gk, qk, cos, sin, rstd, paired, dqk, launch)
        runs.append((q, k, rstd, dqk))
    for ref, got in zip(*runs):
        assert not got.isnan().any() and torch.equal(got, ref)


@pytest.mark.parametrize("paired", [False, True])
def test_the_stationary_half_of_the_table_is_not_read(paired):
    """The tables' columns [D/2, D) (cos 1, sin 0 at every window: tests/test_yarn.py) are not
    loaded: NaN there leaves forward and backward bit for bit as they were."""
    torch.manual_seed(2)
    t, h, d = 9, 6, 16
    yarn = Yarn(head_dim=d, max_position=32, paired=paired)
    yarn.extend_window(16, 48)
    qk = torch.randn(t, 2, h, d)
    gq, gk = torch.randn(2, t * h, d)
    runs = []
    for poison in (False, True):
        cos, sin = (z.clone() for z in yarn.head_tables())
        if poison:
            cos[:, d // 2:], sin[:, d // 2:] = float("nan"), float("nan")
        q, k, rstd = kernel_module._qk_norm_rope_fake(qk, cos, sin, paired)
        kernel_module.forward_into(qk, cos, sin, paired, q, k, rstd)
        dqk = torch.empty_like(qk)
        kernel_module.backward_into(gq, gk, qk, cos, sin, rstd, paired, dqk)
        runs.append((q, k, rstd, dqk))
    for ref, got in zip(*runs):
        assert not got.isnan().any() and torch.equal(got, ref)


def test_a_tiling_must_be_powers_of_two():
    with pytest.raises(ValueError, match="block_rows=3 must be a power of two"):
        Tiling(block_rows=3)
    with pytest.raises(ValueError, match="num_warps=0"):
        Tiling(num_warps=0)


def test_the_tiny_gpt_with_the_kernel_equals_the_torch_path():
    """Loss and every gradient of the tiny model on four heads (paired layers 0 and 3, long
    windows 2 and 5), the kernel installed against the torch path."""
    inputs, targets, cu = _batch(128, 8, 3)
    losses, grads = [], []
    for kernel in (None, qk_norm_rope):
        model = _model(num_heads=4, head_dim=32)
        model.qk_norm_rope = kernel
        loss = model(inputs, targets, cu, _slots(model, inputs), _fcfg([1.0])).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for name, ref in grads[0].items():
        assert torch.allclose(grads[1][name], ref, rtol=1e-3, atol=1e-5), name


def test_under_compile_fullgraph():
    """The op under compile(fullgraph); its backward graph hands the kernel q's and k's gradients
    as they are: no select_backward + add assembling one gradient tensor (the extra pass the
    eighteenth lease's trace showed when q and k were views of one output)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    torch._dynamo.reset()
    yarn = Yarn(head_dim=32, max_position=64, paired=True)
    qk = torch.randn(8, 2, 4, 32, requires_grad=True)
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def scaled(x):  # q and k used inside the graph, as the model's attention does
        return tuple(z * 1.5 for z in _fused(x, yarn, True))

    q, k = torch.compile(scaled, fullgraph=True, backend=backend)(qk)
    rq, rk = (z * 1.5 for z in norm_rotate(qk, yarn, True))
    assert torch.allclose(q, rq, **TOL[torch.float32]) and torch.allclose(k, rk, **TOL[torch.float32])
    (q.sum() + k.sum()).backward()
    assert qk.grad is not None and qk.grad.shape == qk.shape
    ops = [str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"]
    assert "track_1_short.qk_norm_rope_bwd.default" in ops, ops
    assert not [o for o in ops if "select_backward" in o or o.startswith("aten.add")], ops


def test_a_gradient_through_q_alone():
    """k reaches no loss: its gradient is zeros, as in the torch path."""
    torch.manual_seed(0)
    yarn = Yarn(head_dim=32, max_position=64)
    qk = torch.randn(10, 2, 3, 32)
    grads = []
    for fn in (norm_rotate, _fused):
        x = qk.clone().requires_grad_(True)
        q, _ = fn(x, yarn, False)
        (q * torch.arange(32.0)).sum().backward()
        grads.append(x.grad)
    assert torch.allclose(grads[1], grads[0], **TOL[torch.float32])
    assert torch.equal(grads[1][:, 1], torch.zeros_like(grads[1][:, 1]))


def test_input_errors():
    yarn = Yarn(head_dim=32, max_position=8)
    cos, sin = yarn.cos, yarn.sin
    with pytest.raises(ValueError, match="contiguous"):
        qk_norm_rope(torch.randn(4, 4, 2, 32).transpose(1, 2), cos, sin, False)
    with pytest.raises(ValueError, match="power of two"):
        qk_norm_rope(torch.randn(4, 2, 2, 24), cos[:, :24].contiguous(), sin[:, :24].contiguous(), False)
    with pytest.raises(ValueError, match="table must be float32"):
        qk_norm_rope(torch.randn(16, 2, 2, 32), cos, sin, False)  # 16 positions, 8 rows
    with pytest.raises(ValueError, match="even head count"):
        qk_norm_rope(torch.randn(4, 2, 3, 32), torch.zeros(8, 32), torch.zeros(8, 32), True)
