"""GPTConfig.mudd (model/mudd.py) on the tiny config: the coefficient layout (HEAD's 26 pre-gate
coefficients; its 41 post-gate ones less DC's 12), the inits that make the model at step 0 the one
without MUDD, XSA's projection, per-token coefficients that reach every part they drive, the
optimizer table, and a short trainer run with both parts on.

Hardware: CPU only, under a minute on 2 cores.
Run: `.venv/bin/python -m pytest tests/test_mudd.py -q`.
"""

import dataclasses
import json
import math

import pytest
import torch
from micro import nano_config

from track_1_short.model.gpt import GPT, GPTConfig, INITS, rms_norm
from track_1_short.model.attention import document_ids
from track_1_short.model.mudd import CONNECTION_IN, CoefBlocks, GateLayout, dc_correction, xsa
from track_1_short.model.mudd_config import MuddConfig
from track_1_short.optim.anvil_config import build_param_cfgs
from track_1_short.train import train
from tests.test_model import _batch, _fcfg, _model, _slots, _store
from tests.test_train import _losses

BOTH = dict(gates=True, connections=True, dc=True)


def _mudd(**fields) -> MuddConfig:
    """The tiny config's layer indices with `fields` changed."""
    return dataclasses.replace(GPTConfig.tiny().mudd, **fields)


def _trunk(model: GPT, inputs, cu) -> torch.Tensor:
    with torch.no_grad():
        return model._trunk(inputs, cu, _slots(model, inputs), None, None, None, 32, 96, 256, model.matmuls)


def _same_weights(dst: GPT, src: GPT):
    """Copy every parameter the two models share by name, and the n-gram table."""
    theirs = dict(src.named_parameters())
    with torch.no_grad():
        for name, p in dst.named_parameters():
            if name == "ve_gate_bank":  # a connected last layer has no entry: copy by layer
                for layer, k in dst.ve_gate_slot.items():
                    p[k].copy_(src.ve_gate_bank[src.ve_gate_slot[layer]])
            elif name in theirs:
                p.copy_(theirs[name])
    _store(dst).table.copy_(_store(src).table)


def test_layout_of_the_speedrun_model_is_heads():
    """Speedrun layers: pre gate (layers 0-3) XSA 1, 3 (12) + output gate 3 (6) + x0/n-gram of
    0-3 (8) = 26; post gate XSA 4, 7 (12) + output gate 10 (6) + x0/n-gram of 4, 5, 7, 8, 9 (10:
    6 has no attention, 10 is connected) + skip (1) + DC's w1, w2 on 10 (12) = 41: HEAD's counts."""
    c = GPTConfig(mudd=MuddConfig(**BOTH))
    layout = GateLayout.build(c.mudd, c.num_layers, c.num_heads, c.attention_layers,
                              c.no_attention_layer, INITS)
    assert [len(b) for b in layout.inits] == [26, 41]  # with DC's 2 x 6 head weights on layer 10
    # by layer: 0 x0/n-gram [0, 2); 1 XSA [2, 8), x0/n-gram; 2 x0/n-gram; 3 XSA [12, 18), gate [18, 24)
    assert layout.where[(3, "attn_gate")] == (0, 18, 6) and (10, "x0") not in layout.where
    assert layout.where[(1, "ngram")] == (0, 9, 1) and layout.inits[0][9] == 0.05
    block, start, _ = layout.where[(6, "skip")]
    assert block == 1 and layout.inits[1][start] == 0.5 and (6, "x0") not in layout.where
    assert layout.inits[0][18:24] == (0.25,) * 6
    block, start, width = layout.where[(10, "dc_w1")]
    assert (block, width) == (1, 6) and layout.inits[1][start:start + 12] == (1.0,) * 6 + (0.0,) * 6
    without = GateLayout.build(MuddConfig(gates=True), c.num_layers, c.num_heads,  # no DC, no connections
                               c.attention_layers, c.no_attention_layer, INITS)
    assert len(without.inits[1]) == 31 and (10, "x0") in without.where  # the gates serve layer 10


@pytest.mark.parametrize("fields, match", [
    (dict(gates=True, xsa_layers=(0,)), "xsa_layers has \\[0\\]: XSA needs an unpaired"),
    (dict(gates=True, attn_gate_layers=(4,)), "attn_gate_layers has \\[4\\]"),
    (dict(gates=True, split_layer=6), "split_layer=6"),
    (dict(connections=True, source_layer=5), "source_layer=5"),
    (dict(hidden=0), "hidden=0"),
    (dict(dc=True), "dc takes its head weights from the gates"),
    (dict(gates=True, dc=True, dc_layers=(3,)), "dc_layers has \\[3\\]: DC needs an unpaired"),
])
def test_config_names_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.tiny(mudd=_mudd(**fields))


def test_connections_refuse_a_constant_backout():
    with pytest.raises(ValueError, match="connections learn the backout"):
        GPTConfig.tiny(mudd=_mudd(connections=True), backout_layer=3, backout=-0.5)


def test_at_init_the_gated_model_is_the_scalar_one():
    """W2 starts at zero, so every gate equals its init: x0 0, n-gram 0.05, skip 0.5, XSA
    tanh(0) = 0. With the output gates' init at 1 the gated trunk equals the scalar model's (same
    weights otherwise); with HEAD's 0.25 it does not."""
    inputs, _, cu = _batch(128, 8, 3)
    base = _model()
    gated = _model(mudd=_mudd(gates=True, dc=True, attn_gate_init=1.0))  # DC's w2 starts at 0
    _same_weights(gated, base)
    assert not hasattr(gated, "x0_lambdas") and not hasattr(gated, "skip_gate")
    ref = _trunk(base, inputs, cu)
    assert torch.allclose(_trunk(gated, inputs, cu), ref, atol=1e-5)
    heads = _model(mudd=_mudd(gates=True))
    _same_weights(heads, base)
    assert not torch.allclose(_trunk(heads, inputs, cu), ref, atol=1e-3)


def test_at_init_the_connected_model_is_the_constant_backout():
    """Connections at init: no V term, no recombination, the last layer's lambdas and x0 /
    n-gram coefficients equal the scalars, and the final norm reads x - 0.5 h_source: the model
    with GPTConfig.backout_layer = source_layer, backout = -0.5 (given the scalar model's VE gate,
    2 sigmoid(0) = 1, as ve_gate_init)."""
    inputs, _, cu = _batch(128, 8, 3)
    base = _model(backout_layer=3, backout=-0.5)
    connected = _model(mudd=_mudd(connections=True, ve_gate_init=1.0))
    _same_weights(connected, base)
    ref = _trunk(base, inputs, cu)
    assert torch.allclose(_trunk(connected, inputs, cu), ref, atol=1e-5)
    both = _model(mudd=_mudd(**BOTH, ve_gate_init=1.0, attn_gate_init=1.0))
    _same_weights(both, base)
    assert torch.allclose(_trunk(both, inputs, cu), ref, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_coefficients_over_aligned_columns_equal_the_plain_formula(dtype):
    """CoefBlocks computes its output GEMM over GEMM_ALIGN-padded columns: values and every
    gradient equal (W2 gelu(W1 x) + b) * s with the block's n columns, within rounding (26 and 41
    here, neither a multiple of 8; and 5, fewer than 8)."""
    torch.manual_seed(0)
    blocks = CoefBlocks(32, 16, [[0.1] * 26, [0.2] * 41, [0.3] * 5], scale=0.5, learn_scale=True)
    with torch.no_grad():
        blocks.w2.normal_()
    x = torch.randn(40, 32, dtype=dtype)
    for block, n in enumerate((26, 41, 5)):
        blocks.zero_grad()
        xs = x.clone().requires_grad_()
        out = blocks(xs, block)
        assert out.shape == (40, n) and out.dtype == dtype
        g = torch.randn_like(out)
        (out * g).sum().backward()
        got = [xs.grad, blocks.w1.grad, blocks.w2.grad, blocks.b2.grad, blocks.scale.grad]
        ref_params = [p.detach().clone().requires_grad_() for p in (blocks.w1, blocks.w2, blocks.b2, blocks.scale)]
        w1, w2, b2, scale = ref_params
        xr = x.clone().requires_grad_()
        h = torch.nn.functional.gelu(torch.nn.functional.linear(xr, w1[block].to(dtype)))
        ref = (torch.nn.functional.linear(h, w2[block, :n].to(dtype)) + b2[block, :n].to(dtype)) * scale.to(dtype)
        (ref * g).sum().backward()
        # float32: within rounding (a GEMM of another width may sum in another order)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out, ref, **tol)
        for a, b in zip(got, [xr.grad, w1.grad, w2.grad, b2.grad, scale.grad]):
            torch.testing.assert_close(a, b, **tol)
        assert blocks.w2.grad[block, n:].abs().sum() == 0  # the padding reaches no parameter


def test_xsa_removes_the_component_along_the_own_value():
    g = torch.Generator().manual_seed(0)
    y, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    full = xsa(y, v, torch.full((5, 2), 30.0))  # tanh(30) = 1 in float32
    assert torch.allclose((full * v).sum(-1), torch.zeros(5, 2), atol=1e-5)
    assert torch.equal(xsa(y, v, torch.zeros(5, 2)), y)
    half = xsa(y, v, torch.full((5, 2), math.atanh(0.5)))
    assert torch.allclose(half, 0.5 * (y + full), atol=1e-6)


def _dc_dense(q, k, v, cu, w1, w2, scale, window):
    """DC written out over [T, T]: the definition dc_correction blocks."""
    t = q.shape[0]
    doc = document_ids(cu, t)
    rel = torch.arange(t)[:, None] - torch.arange(t)[None, :]
    allowed = (rel >= 0) & (rel < window) & (doc[:, None] == doc[None, :])
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)  # [H, T, T]
    a = torch.einsum("hqk,qh->qk", p, w1)  # [T, T]
    return torch.einsum("qk,khd->qhd", a, v) * w2[..., None]


@pytest.mark.parametrize("lengths, window", [([200], 112), ([5, 130, 1, 64], 7), ([300, 100], 1),
                                             ([300, 100], 129), ([400], 300)])
def test_dc_blocked_equals_the_dense_definition(lengths, window):
    """Queries of several blocks (T not a multiple of 128), documents shorter and longer than the
    window, window 1 (each token its own value), windows reaching one and two blocks back;
    output and every input's gradient."""
    from tests.test_attention import _cu

    t = sum(lengths)
    g = torch.Generator().manual_seed(len(lengths))
    inputs = [torch.randn(t, 3, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    inputs += [torch.randn(t, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    cu = _cu(lengths, capacity=8)
    dy = torch.randn(t, 3, 8, generator=g, dtype=torch.float64)
    results = []
    for fn in (dc_correction, _dc_dense):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = fn(*leaves[:3], cu, *leaves[3:], 0.3, window)
        results.append((out, torch.autograd.grad(out, leaves, dy)))
    (got, grads), (ref, ref_grads) = results
    torch.testing.assert_close(got, ref)
    for name, gr, r in zip(("q", "k", "v", "w1", "w2"), grads, ref_grads):
        torch.testing.assert_close(gr, r, msg=lambda m, name=name: f"d{name}: {m}")
    q, k, v, w1, w2 = inputs
    if window == 1:  # p is 1 on the token itself: a(t, t) = sum of w1
        torch.testing.assert_close(got.detach(), v * (w1.sum(-1, keepdim=True) * w2)[..., None])


@pytest.mark.parametrize("t, window", [(200, 112), (128, 1), (300, 129), (50, 300)])
def test_dc_block_windows_hold_the_rows_before_each_block(t, window):
    """block_windows: row j of block n is position n*128 - (window - 1) + j, zero outside [0, T)."""
    from track_1_short.model.mudd import DC_BLOCK, block_windows

    x = torch.arange(1, t + 1, dtype=torch.float64)[:, None]  # position p holds p + 1
    nb = -(-t // DC_BLOCK)
    got = block_windows(x, nb, window)
    assert got.shape == (nb, window - 1 + DC_BLOCK, 1)
    pos = torch.arange(nb)[:, None] * DC_BLOCK - (window - 1) + torch.arange(window - 1 + DC_BLOCK)
    want = torch.where((pos >= 0) & (pos < t), pos + 1, 0).to(torch.float64)
    assert torch.equal(got[..., 0], want)


def _live(model: GPT, seed=1):
    """Non-zero W2 so the coefficients vary per token (as after training)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".w2"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_per_token_coefficients_drive_the_model_and_get_gradient():
    """With W2 non-zero the trunk changes, every MUDD parameter gets a gradient, and each
    block's coefficients vary over tokens; changing one role's bias changes the output."""
    inputs, targets, cu = _batch(128, 8, 3)
    model = _model(mudd=_mudd(**BOTH))
    before = _trunk(model, inputs, cu)
    _live(model)
    assert not torch.allclose(_trunk(model, inputs, cu), before, atol=1e-3)
    loss = model(inputs, targets, cu, _slots(model, inputs), _fcfg([1.0, 0.5])).sum()
    loss.backward()
    for name, p in model.named_parameters():
        if name.startswith("mudd_"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    x0 = rms_norm(torch.randn(16, 128))
    assert model.mudd_gates(x0, 0).std(0).min() > 0 and model.mudd_connections(x0, 1).std(0).min() > 0
    out = _trunk(model, inputs, cu)
    for role in ("v_embed", "r_source", "ve_gate_a", "post_attn", "x0", "ngram", "post_mlp"):
        k = CONNECTION_IN.index(role)
        with torch.no_grad():
            model.mudd_connections.b2[0, k] += 1.0
        assert not torch.allclose(_trunk(model, inputs, cu), out, atol=1e-4), role
        with torch.no_grad():
            model.mudd_connections.b2[0, k] -= 1.0


def test_optimizer_table_and_dtypes():
    model = GPT(GPTConfig.tiny(mudd=_mudd(**BOTH)))
    cfgs = build_param_cfgs(model.named_parameters())
    by_name = {name: cfgs[p] for name, p in model.named_parameters()}
    assert by_name["mudd_gates.w1"].lr_mul == 0.1 and by_name["mudd_gates.w1"].wd_mul == 1.0
    assert by_name["mudd_gates.scale"].wd_mul == 0.0 and by_name["mudd_gates.b2"].wd_mul == 0.0
    assert by_name["mudd_connections.w2"].lr_mul == 0.25
    assert by_name["mudd_connections.b2"].wd_mul == 0.0
    assert all(c.optim == "adam" and c.comm == "all_reduce"
               for n, c in by_name.items() if n.startswith("mudd_"))
    assert model.mudd_gates.scale.dim() == 0 and model.mudd_gates.scale.item() == pytest.approx(0.1)


def _nano_mudd(shard_dir, runs_dir, run_id, **train_kw):
    """The nano trainer config (3 layers: 0 paired, 1 no attention, 2 long) with both parts on."""
    cfg = nano_config(shard_dir, runs_dir, run_id, **train_kw)
    cfg.model = dataclasses.replace(cfg.model, mudd=MuddConfig(
        gates=True, connections=True, dc=True, split_layer=1, xsa_layers=(2,),
        attn_gate_layers=(0, 2), source_layer=1, dc_layers=(2,), dc_window=16))
    return cfg


def test_trainer_trains_mudd_and_resumes_exactly(shard_dir, tmp_path):
    """The trainer with both parts on: four steps (two Adam steps: W1's gradient flows through
    W2, which the first one moves off zero) move every MUDD parameter, and
    a run resumed from step 8 continues bit-equal (the parameters and their Adam state are in
    the checkpoint; the config records the parts)."""
    from track_1_short.distributed import init_distributed
    from track_1_short.trainer.build import build_run, make_loader, make_spec
    from track_1_short.trainer.step import train_step
    from track_1_short.trainer.stop import GracefulStop

    cfg = _nano_mudd(shard_dir, tmp_path, "steps")
    ctx = init_distributed(60, "cpu")
    run = build_run(make_spec(cfg, ctx, tmp_path / "steps"), GracefulStop(ctx))
    mudd = {n: p.detach().clone() for n, p in run.parts.model.named_parameters() if n.startswith("mudd_")}
    assert len(mudd) == 7  # gates w1, w2, b2, scale; connections w1, w2, b2
    loader = make_loader(run.spec)
    try:
        for step in range(4):
            train_step(run.spec, run.parts, step, loader, run.log.timer)
    finally:
        loader.close()
    params = dict(run.parts.model.named_parameters())
    assert [n for n, p in mudd.items() if torch.equal(params[n], p)] == []

    assert train(_nano_mudd(shard_dir, tmp_path, "full")) == 0
    assert train(_nano_mudd(shard_dir, tmp_path, "first", max_steps=8)) == 0
    ckpt = tmp_path / "first" / "ckpt_step000008"
    assert train(_nano_mudd(shard_dir, tmp_path, "resumed", resume=ckpt)) == 0
    full, first, resumed = (_losses(tmp_path / n) for n in ("full", "first", "resumed"))
    assert {s: full[s] for s in range(8)} == first
    assert {s: full[s] for s in range(8, 12)} == resumed
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert config["model"]["mudd"]["gates"] is True and config["model"]["mudd"]["connections"] is True


def test_compiles_fullgraph_and_equals_eager():
    """torch.compile(fullgraph=True, dynamic=False) over the model with both parts on: one graph
    (no break on the per-layer mixes), the loss and every MUDD gradient equal to eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from tests.test_model import SMALL_VOCAB

    model = _model(vocab_size=SMALL_VOCAB, mudd=_mudd(**BOTH))
    _live(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=counter)
    inputs, targets, cu = _batch(64, 8, 3, vocab=SMALL_VOCAB)
    slots = _slots(model, inputs)
    grads = []
    for run in (model, compiled):
        model.zero_grad(set_to_none=True)
        loss = run(inputs, targets, cu, slots, _fcfg([1.0, 0.5], ws=(16, 48), max_len=32))
        loss.sum().backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                      if n.startswith("mudd_")}))
    assert counter.frame_count == 1
    (eager_loss, eager_grads), (loss, compiled_grads) = grads
    assert torch.allclose(loss, eager_loss, atol=1e-5)
    for name, g in eager_grads.items():
        assert torch.allclose(compiled_grads[name], g, atol=1e-5, rtol=1e-4), name


@pytest.mark.slow  # ~1 min on 2 cores (two aot_eager compiles); `./test.sh -m slow`
def test_graph_path_with_mudd_equals_eager(shard_dir, tmp_path):
    """--graphs on with every MUDD part (the CPU stand-in graph backend, aot_eager compile):
    warmup captures and self-checks every key with the MUDD parameters in the census, and the
    losses equal the eager run's."""
    import torch._dynamo

    from track_1_short.perf.cuda_graphs.capture_support import RecordingGraphBackend

    torch._dynamo.reset()
    assert train(_nano_mudd(shard_dir, tmp_path, "eager")) == 0
    cfg = _nano_mudd(shard_dir, tmp_path, "graphs", compile=True, compile_backend="aot_eager")
    cfg.graphs = dataclasses.replace(cfg.graphs, mode="on")
    assert train(cfg, graph_backend=RecordingGraphBackend()) == 0
    report = json.loads((tmp_path / "graphs" / "summary.json").read_text())["capture_report"]
    assert len(report) == 2 and all(row["self_checks"] >= 1 for row in report)
    assert _losses(tmp_path / "graphs") == pytest.approx(_losses(tmp_path / "eager"), rel=1e-4)
    torch._dynamo.reset()
