"""The fused ReLU^2 MLP strategy (kernels/relu2_mlp.py, TrainConfig.mlp_kernel="quack") on the
CPU: with torch stand-ins for quack's gemm_act / gemm_dact it equals the reference
(PlainMatmuls.relu2_mlp) in output and every gradient, eagerly, under
torch.compile(fullgraph=True) and inside the whole GPT; the install refuses a device it cannot run
on, and the config refuses it beside fp8 MLP sites. The kernels: tests/test_relu2_mlp_gpu.py.

Hardware: CPU only, ~20 s. Run: `.venv/bin/python -m pytest tests/test_relu2_mlp.py -q`.
"""

import pytest
import torch

from track_1_short import config
from track_1_short.kernels import relu2_mlp
from track_1_short.model.fp8 import PlainMatmuls
from tests.test_model import _batch, _fcfg, _model, _slots


class _StandIn:
    """quack.gemm_interface's two epilogue GEMMs in torch: relu_sq(x) = max(x, 0) * x."""

    def __init__(self):
        self.calls = []

    def _record(self, *call):
        if not torch.compiler.is_compiling():  # a traced list append would be a graph break
            self.calls.append(call)

    def gemm_act(self, A, B, *, activation, store_preact):
        self._record("gemm_act", activation, store_preact)
        pre = A @ B
        return pre, torch.relu(pre) * pre

    def gemm_dact(self, A, B, PreAct, *, activation):
        self._record("gemm_dact", activation)
        return (A @ B) * 2 * torch.relu(PreAct), torch.relu(PreAct) * PreAct


@pytest.fixture
def stand_in(monkeypatch):
    fake = _StandIn()
    monkeypatch.setattr(relu2_mlp, "_lib", fake)
    return fake


def _fused_matmuls() -> PlainMatmuls:
    matmuls = PlainMatmuls()
    matmuls.use_fused_mlp(relu2_mlp.quack_relu2_mlp, relu2_mlp.QUACK_MLP_LABEL)
    return matmuls


def _operands(t=24, d=16, f=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w_up, w_down = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((t, d), (f, d), (f, d)))
    return x, w_up, w_down


@pytest.mark.parametrize("compiled", [False, True])
def test_equals_the_reference_with_gradients(stand_in, compiled):
    x, w_up, w_down = _operands()
    fused = _fused_matmuls().relu2_mlp
    run = torch.compile(fused, fullgraph=True, dynamic=False, backend="aot_eager") if compiled else fused
    results = []
    for fn in (run, PlainMatmuls().relu2_mlp):
        leaves = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
        y = fn(*leaves, layer=0)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
        results.append((y, torch.autograd.grad(y, leaves, dy)))
    (y, grads), (ref, ref_grads) = results
    assert torch.allclose(y, ref)
    for name, g, r in zip(("x", "w_up", "w_down"), grads, ref_grads):
        assert torch.allclose(g, r), name
    if not compiled:
        assert stand_in.calls == [("gemm_act", "relu_sq", True), ("gemm_dact", "relu_sq")]


def test_the_whole_model_equals_the_torch_mlp(stand_in):
    """The tiny GPT with the strategy installed: loss and every gradient equal the plain model's
    (eval keeps the plain matmuls: its CE is unchanged too)."""
    inputs, targets, cu = _batch(128, 8, 3)
    losses, grads = [], []
    for fused in (False, True):
        model = _model()
        if fused:
            model.matmuls.use_fused_mlp(relu2_mlp.quack_relu2_mlp, relu2_mlp.QUACK_MLP_LABEL)
        loss = model(inputs, targets, cu, _slots(model, inputs), _fcfg([1.0, 0.5])).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(losses[0], losses[1], rtol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5), name


def test_refused_where_it_cannot_run(tmp_path):
    from track_1_short.trainer.build import prepare_for_device

    with pytest.raises(ValueError, match="--mlp-kernel quack cannot run on cpu: needs CUDA"):
        prepare_for_device(_model(), torch.device("cpu"), mlp_kernel="quack")
    with pytest.raises(SystemExit) as e:
        config.parse(["--preset", "small-gpu", "--data-dir", str(tmp_path), "--mlp-kernel", "quack",
                      "--fp8"])
    assert e.value.code == 2
    cfg = config.parse(["--preset", "small-gpu", "--data-dir", str(tmp_path), "--mlp-kernel", "quack",
                        "--fp8", "--set", "model.fp8.sites=lm_head"])
    assert cfg.train.mlp_kernel == "quack"


def test_installed_inside_the_fp8_strategy_keeping_its_lm_head(stand_in, monkeypatch):
    """--mlp-kernel quack with fp8 on the lm head alone: the install keeps the installed
    Fp8Matmuls (whose lm-head scales the fused fp8 loss reads) and only the MLP becomes quack's.
    (The install used to replace the strategy, so the lm head silently ran bf16: seen in the
    H200 kernel list of 2026-12-02, docs/results/README.md.) Fp8 MLP sites refuse a fused MLP."""
    from track_1_short.model.fp8 import Fp8Matmuls
    from track_1_short.model.fp8_config import Fp8Config
    from track_1_short.trainer import build

    monkeypatch.setattr(relu2_mlp, "quack_unavailable_reason", lambda device: None)
    model = _model()
    layers = model.config.num_layers
    model.config.fp8 = Fp8Config(enabled=True, sites=("lm_head",))
    fp8 = Fp8Matmuls(model.config.fp8, num_layers=layers)
    model.matmuls = fp8
    build._install_mlp_kernel(model, torch.device("cpu"), "quack")
    assert model.matmuls is fp8 and build._fp8_sites(model) == ("lm_head",)
    assert "quack" in build.describe_strategies(model) and "fp8 (lm_head)" in build.describe_strategies(model)
    x, w_up, w_down = _operands()
    y = model.matmuls.relu2_mlp(x, w_up, w_down, layer=0)
    assert stand_in.calls == [("gemm_act", "relu_sq", True)]
    assert torch.allclose(y, PlainMatmuls().relu2_mlp(x, w_up, w_down, layer=0))
    with pytest.raises(ValueError, match=r"cannot take the fp8 sites \['mlp_down', 'mlp_up'\]"):
        Fp8Matmuls(Fp8Config(enabled=True), num_layers=layers).use_fused_mlp(
            relu2_mlp.quack_relu2_mlp, relu2_mlp.QUACK_MLP_LABEL)
