"""GPT on the tiny config: config validation, parameter layout (banks vs Adam), loss at init, the
training loss against eval CE and direct MTP/prefix references, the value-embedding pull against
the dense path, and torch.compile(fullgraph=True, dynamic=False) over four keys shaped like the
speedrun's stages with zero recompiles after each key's first step.

Hardware: CPU only. The compile tests use the aot_eager backend (dynamo + AOTAutograd: catches graph
breaks, recompiles and backward-tracing problems); the one-key test runs in CI, the four-key test
and the inductor variant are `slow` (each under 2 minutes on 2 cores).
Run: `.venv/bin/python -m pytest tests/test_model.py -q`; slow ones: add `-m slow`.
"""

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from track_1_short.model.tokens import BOS_ID
from track_1_short.model.gpt import GPT, ForwardScheduleConfig, GPTConfig, rms_norm
from track_1_short.model.loss import softcap
from track_1_short.model.ngram_config import NgramConfig
from track_1_short.optim.anvil_config import build_param_cfgs
from track_1_short.perf.ngram_store import NgramStore

VOCAB = 50304
_STORES: "weakref.WeakKeyDictionary[GPT, NgramStore]" = weakref.WeakKeyDictionary()


def _store(model: GPT) -> NgramStore:
    """The model's n-gram table (as the trainer builds one beside each model)."""
    if model not in _STORES:
        _STORES[model] = NgramStore(model.ngram_table, cycle=1, micro_steps=1)  # rows only
    return _STORES[model]


def _slots(model: GPT, inputs: torch.Tensor) -> torch.Tensor:
    """ngram_slots of `inputs`, the row cache filled from the model's table."""
    return _store(model).slots_for(inputs)


def _model(seed=0, live_attention=True, **config):
    torch.manual_seed(seed)
    model = GPT(GPTConfig.tiny(**config))
    if live_attention:  # O projections and c_proj are zero at init; make every path carry gradient
        with torch.no_grad():
            model.vo_bank[1::2].normal_(0, 0.05)
            model.mlp_bank[:, 1].normal_(0, 0.05)
            _store(model).table.normal_(0, 0.1)
    return model


def _batch(t, capacity, num_docs, seed=0, vocab=50257):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, vocab, (t + 1,), generator=g)
    cuts = (torch.randperm(t - 1, generator=g)[: num_docs - 1] + 1).sort().values.tolist()
    cu = torch.tensor([0] + cuts + [t] * (capacity - num_docs), dtype=torch.int32)
    inputs[cu[:num_docs].long()] = min(BOS_ID, vocab - 1)
    return inputs[:-1].to(torch.int32), inputs[1:].clone(), cu


def _fcfg(weights, prefix=0.0, ws=(32, 96), max_len=256):
    return ForwardScheduleConfig(torch.tensor(weights), torch.tensor(prefix), ws[0], ws[1], max_len)


@pytest.mark.parametrize("change,match", [
    (dict(model_dim=100), "model_dim"),
    (dict(num_heads=3, model_dim=192), "num_heads"),
    (dict(long_window_layers=(2, 9)), "long_window_layers"),
    (dict(paired_head_layers=(2,)), "overlap"),
    (dict(value_embed_layers=(4,)), "value_embed_layers"),
    (dict(skip_from_layer=5), "skip_from_layer"),
    (dict(attention_backend="flash"), "attention_backend"),
    (dict(ngram=NgramConfig(dim=64)), "ngram"),
    (dict(attn_out_init="normal"), "attn_out_init"),
    (dict(attn_input_layer=6), "attn_input_layer=6 outside"),
    (dict(backout_layer=-1), "backout_layer=-1 outside"),
    (dict(backout=-0.5), "backout=-0.5 needs a backout_layer"),
])
def test_config_validation(change, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.tiny(**change)


def test_parameter_layout():
    model = GPT(GPTConfig.tiny())
    cfgs = build_param_cfgs(model.named_parameters())
    kinds = {"anvil": [], "adam": []}
    for name, p in model.named_parameters():
        kinds[cfgs[p].optim].append(name)
    assert kinds["anvil"] == ["qk_bank", "vo_bank", "mlp_bank"]
    assert {"embed.weight", "lm_head", "value_embeds.weight", "ve_gate_bank", "smear_gate.weight",
            "sa_lambdas"} <= set(kinds["adam"])
    assert set(kinds["anvil"]) | set(kinds["adam"]) == {n for n, _ in model.named_parameters()}
    assert model.qk_bank.shape == (16, 128, 128)  # 5 attention layers x 2 heads = 10, padded to 8k
    assert model.vo_bank.shape == (16, 128, 128) and model.mlp_bank.shape == (8, 2, 512, 128)
    assert model.qk_bank[10:].abs().sum() == 0 and model.vo_bank[10:].abs().sum() == 0
    assert model.mlp_bank[6:].abs().sum() == 0 and model.mlp_bank[:, 1].abs().sum() == 0
    assert torch.equal(model.embed.weight, model.lm_head.T) and model.lm_head.shape == (128, VOCAB)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_attention_output_init_zero_or_uniform_like_v():
    """attn_out_init="zero": every O entry (odd vo_bank entries) is zero; "uniform": drawn like the
    V entries (std 0.5/sqrt(D)); the padding stays zero either way."""
    zero, uniform = GPT(GPTConfig.tiny()), GPT(GPTConfig.tiny(attn_out_init="uniform"))
    n = 2 * len(GPTConfig.tiny().attention_layers)  # 10 V/O entries, padded to 16
    assert zero.vo_bank[1:n:2].abs().sum() == 0 and (zero.vo_bank[0:n:2] != 0).float().mean() > 0.99
    o, v = uniform.vo_bank[1:n:2], uniform.vo_bank[0:n:2]
    bound = 3 ** 0.5 * 0.5 * 128 ** -0.5
    assert (o != 0).float().mean() > 0.99 and o.abs().max() <= bound
    assert o.std().item() == pytest.approx(v.std().item(), rel=0.02)
    assert uniform.vo_bank[n:].abs().sum() == 0


def _spied_trunk(model: GPT, inputs, cu, slots):
    """The trunk's output plus, per layer, the attention input it got and its MLP block's output."""
    attn_in, mlp_out = {}, {}
    attention_block, mlp_block = model._attention_block, model._mlp_block

    def spy_attention(i, x, *args):
        attn_in[i] = (args[-3], x)  # (attention input, residual); then the LayerMix, BankViews
        return attention_block(i, x, *args)

    def spy_mlp(i, x, *args):
        mlp_out[i] = mlp_block(i, x, *args)
        return mlp_out[i]

    model._attention_block, model._mlp_block = spy_attention, spy_mlp
    with torch.no_grad():
        out = model._trunk(inputs, cu, slots, None, None, None, 32, 96, 256, model.matmuls)
    return out, attn_in, mlp_out


def test_later_layers_attend_over_an_earlier_residual_and_the_backout():
    """attn_input_layer=2: layers 3 and 5 (4 has no attention) attend over the residual after
    layer 2, layers 0-2 over their own x; backout: the final norm reads x - 0.5 h_2. Off (None),
    or pointing at the last layer, the trunk is unchanged."""
    inputs, targets, cu = _batch(128, 8, 3)
    base = _model()
    slots = _slots(base, inputs)
    plain, _, _ = _spied_trunk(base, inputs, cu, slots)
    late = _model(attn_input_layer=2, backout_layer=2, backout=-0.5)
    _store(late).table.copy_(_store(base).table)
    out, attn_in, mlp_out = _spied_trunk(late, inputs, cu, _slots(late, inputs))
    for i in (0, 1, 2):
        assert attn_in[i][0] is attn_in[i][1], f"layer {i} attends over its own x"
    for i in (3, 5):  # (layer 3's own x is h_2 too; layer 5's is not)
        assert attn_in[i][0] is mlp_out[2], f"layer {i}"
    assert attn_in[5][1] is not mlp_out[2]
    assert torch.allclose(out, rms_norm(mlp_out[5] - 0.5 * mlp_out[2]))
    assert not torch.allclose(out, plain)
    last = _model(attn_input_layer=5, backout_layer=3)  # nothing after 5; a zero backout
    _store(last).table.copy_(_store(base).table)
    same, _, _ = _spied_trunk(last, inputs, cu, _slots(last, inputs))
    assert torch.equal(same, plain)


@pytest.mark.parametrize("paired", [False, True])
def test_norm_rotate_backward_stacks_the_qk_gradient(paired):
    """norm_rotate's backward writes qk's gradient as one stack of the q and k gradients (unbind's
    backward), never as select_backward of each plus an add: on the H200 that add was an extra
    pass over qk's gradient, 11.6 ms per step at stage C (trace of 2026-12-03)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from track_1_short.model.gpt import norm_rotate
    from track_1_short.model.yarn import Yarn

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    yarn = Yarn(16, 64, paired=paired)
    qk = torch.randn(32, 2, 4, 16, requires_grad=True)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    q, k = torch.compile(norm_rotate, backend=backend, fullgraph=True)(qk, yarn, paired)
    (q.sum() + 2 * k.sum()).backward()
    ops = {str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"}
    assert "aten.stack.default" in ops, sorted(ops)
    assert not {o for o in ops if "select_backward" in o}, sorted(ops)


@pytest.mark.parametrize("n,t", [(1, 512), (6, 512), (6, 500)])
def test_narrow_linear_matches_linear_and_never_contracts_all_tokens_in_one_gemm(n, t):
    """model/gpt.narrow_linear (the smear and value-embedding gates): bf16 forward and both
    gradients within bf16 rounding of F.linear in float64 (T = 500: chunks of gcd(500, 64) = 4).
    Compiled, the forward holds no GEMM, and the backward's only one is a bmm over
    gcd(T, 64) chunks: never one GEMM contracting all T tokens (without cuBLAS's workspace that
    ran on one thread block, ~190 us at T = 16384 on an H100; left to autograd, the product's
    weight gradient was an inductor reduction with 72 outputs, ~230 us)."""
    import math

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from track_1_short.model.gpt import GRAD_W_CHUNKS, narrow_linear

    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(t, 12, generator=g, dtype=torch.float64)
    w64 = torch.randn(n, 12, generator=g, dtype=torch.float64) * 0.3
    up = torch.randn(t, n, generator=g, dtype=torch.float64)
    x, w = (v.to(torch.bfloat16).requires_grad_() for v in (x64, w64))
    xr, wr = (v.detach().double().requires_grad_() for v in (x, w))  # the same bf16 values
    out = narrow_linear(x, w)
    ref = F.linear(xr, wr)
    assert out.dtype == torch.bfloat16 and out.shape == (t, n)
    (out.double() * up).sum().backward()
    (ref * up).sum().backward()
    for got, want in ((out, ref), (x.grad, xr.grad), (w.grad, wr.grad)):
        assert got.dtype == torch.bfloat16
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 1e-2, float(err)  # bf16 rounding of the result; F.linear's would be the same

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    xc, wc = (v.detach().clone().requires_grad_() for v in (x, w))
    fn = torch.compile(narrow_linear, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                       fullgraph=True, dynamic=False)
    fn(xc, wc).float().sum().backward()
    assert len(graphs) == 2
    gemm = ("mm", "addmm", "bmm", "matmul", "baddbmm")
    nodes = [[nd for nd in gm.graph.nodes if nd.op == "call_function"
              and str(nd.target).split(".")[1] in gemm] for gm in graphs]
    assert not nodes[0], [str(nd.target) for nd in nodes[0]]
    assert [str(nd.target) for nd in nodes[1]] == ["aten.bmm.default"]
    a, b = (arg.meta["val"] for arg in nodes[1][0].args)
    c = math.gcd(t, GRAD_W_CHUNKS)
    assert tuple(a.shape) == (c, n, t // c) and tuple(b.shape) == (c, t // c, 12)
    assert a.dtype == torch.float32  # float32 sums of the bf16 values


@pytest.mark.parametrize("gates", [False, True])
def test_paired_heads_in_place_equal_the_reference_copies(gates):
    """GPTConfig.paired_head_copies=False (q, k rotated into the paired layout, the projection's
    columns permuted) against True (the reference's copies): the same loss and every gradient, on
    four heads (two would make the permutation the identity), with per-token output gates on a
    paired layer (layer 0) too."""
    from track_1_short.model.mudd_config import MuddConfig
    fields = dict(num_heads=4, head_dim=32)
    if gates:
        fields["mudd"] = MuddConfig(gates=True, split_layer=3, xsa_layers=(1, 2),
                                    attn_gate_layers=(0, 2), source_layer=3)
    inputs, targets, cu = _batch(128, 8, 3)
    grads, losses = [], []
    for copies in (True, False):
        model = _model(paired_head_copies=copies, **fields)
        with torch.no_grad():  # per-head differences everywhere (gates included)
            g = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        loss = model(inputs, targets, cu, _slots(model, inputs), _fcfg([1.0])).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    assert grads[0].keys() == grads[1].keys()
    for name, ref in grads[0].items():
        assert torch.allclose(grads[1][name], ref, rtol=1e-4, atol=1e-6), name
    assert grads[0]["vo_bank"].abs().sum() > 0


@pytest.mark.parametrize("config, shapes", [
    # speedrun: 10 attention layers x 6 heads = 60 qk matrices -> 64, 20 vo -> 24,
    # 11 layers x 2 = 22 mlp matrices -> 24 (12 entries, not 16: padding counts matrices)
    (GPTConfig(), {"qk_bank": (64, 256, 768), "vo_bank": (24, 768, 768),
                   "mlp_bank": (12, 2, 3072, 768)}),
    (GPTConfig.tiny(), {"qk_bank": (16, 128, 128), "vo_bank": (16, 128, 128),
                        "mlp_bank": (8, 2, 512, 128)}),
    # a multiple the entry size does not divide: 11 entries x 2 = 22 -> 24 matrices, 12 entries
    (GPTConfig(bank_pad_multiple=3), {"qk_bank": (60, 256, 768), "vo_bank": (21, 768, 768),
                                      "mlp_bank": (12, 2, 3072, 768)}),
])
def test_bank_padding_counts_matrices(config, shapes):
    with torch.device("meta"):  # shapes only: no memory for the full model
        model = GPT(config)
    for name, shape in shapes.items():
        bank = getattr(model, name)
        assert tuple(bank.shape) == shape, name
        matrices = bank.numel() // (bank.size(-2) * bank.size(-1))
        assert matrices % config.bank_pad_multiple == 0, name
        if config.bank_pad_multiple == 8:  # the optimizer shards them over 1, 2, 4 or 8 ranks
            assert all(matrices % w == 0 for w in (1, 2, 4, 8)), name


def test_loss_at_init_close_to_uniform():
    model = _model(live_attention=False)
    inputs, targets, cu = _batch(256, 8, 3)
    loss = model(inputs, targets, cu, _slots(model, inputs), _fcfg([1.0]))
    assert loss.shape == (256,) and loss.dtype == torch.float32
    assert abs(loss.mean().item() - math.log(VOCAB)) < 0.05


def _consumers(root, leaf: torch.Tensor) -> int:
    """Autograd nodes under `root` that take `leaf`'s gradient (edges into its AccumulateGrad)."""
    seen, stack, count = set(), [root], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is leaf:
                count += 1
            stack.append(nxt)
    return count


def test_each_bank_is_read_once_per_forward():
    """Every layer reads its matrices from one unbind per bank (model/gpt.BankViews): a bank's
    gradient is then one stack, not a sum of one full-bank select backward per layer (which
    inductor fuses into a kernel reading every layer's gradient for each element). The pads get a
    zero gradient."""
    model = _model()
    inputs, targets, cu = _batch(128, 8, 3)
    loss = model(inputs, targets, cu, _slots(model, inputs), _fcfg([1.0])).sum()
    for name in ("qk_bank", "vo_bank", "mlp_bank"):
        assert _consumers(loss.grad_fn, getattr(model, name)) == 1, name
    loss.backward()
    n_qk = len(model.attn_slot) * model.config.num_heads
    assert model.qk_bank.grad[n_qk:].abs().sum() == 0 and model.qk_bank.grad[:n_qk].abs().sum() > 0
    assert model.vo_bank.grad[2 * len(model.attn_slot):].abs().sum() == 0
    nl = model.config.num_layers
    assert model.mlp_bank.grad[nl:].abs().sum() == 0 and model.mlp_bank.grad[:nl, 1].abs().sum() > 0


def test_training_loss_terms_against_eval_and_direct_references():
    model = _model()
    inputs, targets, cu = _batch(128, 8, 3)
    slots = _slots(model, inputs)
    table = torch.where(torch.rand(VOCAB) < 0.7, torch.randint(0, VOCAB, (VOCAB,)), -1)
    model.set_prefix_table(table)
    with torch.no_grad():
        plain = model(inputs, targets, cu, slots, _fcfg([1.0]))
        ce = model.eval_ce(inputs, targets, cu, slots, 32, 96, 256)
        assert torch.allclose(plain, ce, atol=1e-5)
        x = model._trunk(inputs, cu, slots, None, None, None, 32, 96, 256, model.matmuls)
        capped = softcap(x @ model.lm_head).double()
        lse = capped.logsumexp(-1)
        w = [1.0, 0.5, 0.25]
        full = model(inputs, targets, cu, slots, _fcfg(w, prefix=0.25))
    t = 128
    expect = torch.zeros(t, dtype=torch.float64)
    for k in range(3):
        expect[: t - k] += w[k] * (lse[: t - k] - capped[torch.arange(t - k), targets[k:]])
    pref = table[targets]
    has = pref >= 0
    expect[has] += 0.25 * (lse[has] - capped[has.nonzero()[:, 0], pref[has]])
    assert torch.allclose(full.double(), expect, atol=1e-4)


def test_value_embed_and_embed_pull_equal_dense_and_sink_gets_gradient():
    """The pulled gradients (value embeddings and token embedding, model/value_embed.pull_rows)
    equal the dense ones, summed over two backwards (the micro-steps of one step) with repeated
    tokens in each; the pulled tables get no .grad and every other gradient is unchanged."""
    fc = _fcfg([1.0, 0.5], prefix=0.0)
    dense_model, pull_model = _model(), _model()
    pulled = {"value_embeds.weight": pull_model.value_embeds.grad_accum,
              "embed.weight": pull_model.embed_grad_accum}
    sink = pull_model.ngram_table.grad_sink(128)
    for seed in (3, 4):
        inputs, targets, cu = _batch(128, 8, seed)
        assert inputs.unique().numel() < inputs.numel()  # repeated rows sum in the buffer
        slots = _slots(dense_model, inputs)
        dense_model(inputs, targets, cu, slots, fc).sum().backward()
        _slots(pull_model, inputs)
        pull_model(inputs, targets, cu, slots, fc, ngram_sink=sink,
                   value_embed_grad=pulled["value_embeds.weight"],
                   embed_grad=pulled["embed.weight"]).sum().backward()
    dense = dict(dense_model.named_parameters())
    for name, buffer in pulled.items():
        assert dict(pull_model.named_parameters())[name].grad is None, name
        assert buffer.dtype == torch.float32 and dense[name].grad.abs().sum() > 0
        assert torch.allclose(buffer, dense[name].grad, atol=1e-6), name
    assert sink.grad is not None and sink.grad.abs().sum() > 0
    for name, p in pull_model.named_parameters():
        if name not in pulled:
            assert torch.allclose(p.grad, dense[name].grad, atol=1e-6), name


def test_prefix_table_filled_in_place():
    model = GPT(GPTConfig.tiny())
    ptr = model.prefix_table.data_ptr()
    model.set_prefix_table(torch.arange(VOCAB) - 1)
    assert model.prefix_table.data_ptr() == ptr and model.prefix_table[5] == 4


# Four keys with the speedrun's structure, scaled down: (T, cu_seqlens rows, MTP weights,
# (ws_short, ws_long), max_seq_len); ws_long changes between keys move YaRN (attn_scale). The
# compile tests use a small vocabulary (BOS kept inside it): graph breaks and recompiles do not
# depend on V, while [T, 50304] logits made the CPU test take minutes.
KEYS = [
    (64, 8, [1.0, 0.5, 0.25], (16, 48), 32),
    (128, 12, [1.0, 0.5], (24, 64), 64),
    (192, 16, [1.0], (32, 80), 64),
    (192, 16, [1.0], (40, 96), 64),
]
SMALL_VOCAB = 1024  # _batch starts documents with token SMALL_VOCAB - 1 instead of BOS


def _run_keys(compiled, model, steps_per_key, check_eager=False):
    """Visit the keys in schedule order; returns the compile count after each key."""
    counts, old_long = [], KEYS[0][3][1]
    for k, (t, cap, weights, ws, max_len) in enumerate(KEYS):
        model.apply_window_change(old_long, ws[1])
        old_long = ws[1]
        for step in range(steps_per_key):
            inputs, targets, cu = _batch(t, cap, num_docs=2 + step % 3, seed=100 * k + step,
                                         vocab=SMALL_VOCAB)
            slots = _slots(model, inputs)
            w = [x * (1 - 0.1 * step) for x in weights]
            fc = ForwardScheduleConfig(torch.tensor(w), torch.tensor(0.25 - 0.02 * step), *ws, max_len)
            sink = model.ngram_table.grad_sink(t)
            loss = compiled(inputs, targets, cu, slots, fc, ngram_sink=sink,
                            value_embed_grad=model.value_embeds.grad_accum)
            loss.sum().backward()
            if check_eager and step == 0:
                with torch.no_grad():
                    eager = model(inputs, targets, cu, slots, fc)
                assert torch.allclose(loss, eager, atol=1e-4)
        counts.append(compiled.counter.frame_count)
    return counts


def test_compile_one_key_fullgraph():
    """CI-sized: one key, fullgraph forward+backward, a second step reuses the graph."""
    model = _model(vocab_size=SMALL_VOCAB)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=counter)
    t, cap, weights, ws, max_len = KEYS[0]
    for step in range(2):
        inputs, targets, cu = _batch(t, cap, 2 + step, seed=step, vocab=SMALL_VOCAB)
        slots = _slots(model, inputs)
        fc = ForwardScheduleConfig(torch.tensor(weights), torch.tensor(0.25), *ws, max_len)
        compiled(inputs, targets, cu, slots, fc, ngram_sink=model.ngram_table.grad_sink(t),
                 value_embed_grad=model.value_embeds.grad_accum).sum().backward()
    assert counter.frame_count == 1


@pytest.mark.slow  # ~85 s on 2 busy cores (four AOTAutograd compiles)
def test_compile_four_keys_fullgraph_no_recompiles():
    model = _model(vocab_size=SMALL_VOCAB)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=counter)
    compiled.counter = counter
    counts = _run_keys(compiled, model, steps_per_key=6, check_eager=True)
    assert counts == [1, 2, 3, 4], f"one compile per key expected, got cumulative {counts}"
    model.reset_yarn()


@pytest.mark.slow  # ~110 s on 2 busy cores
def test_compile_inductor_one_key():
    model = _model(vocab_size=SMALL_VOCAB)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=counter)
    compiled.counter = counter
    t, cap, weights, ws, max_len = KEYS[0]
    for step in range(2):
        inputs, targets, cu = _batch(t, cap, 2 + step, seed=step, vocab=SMALL_VOCAB)
        slots = _slots(model, inputs)
        fc = ForwardScheduleConfig(torch.tensor(weights), torch.tensor(0.25), *ws, max_len)
        loss = compiled(inputs, targets, cu, slots, fc)
        loss.sum().backward()
        with torch.no_grad():
            assert torch.allclose(loss, model(inputs, targets, cu, slots, fc), atol=1e-3)
    assert counter.frame_count == 1


def test_strategies_are_installed_from_outside():
    """trainer/build.py installs the training forward's strategies: fp8 matmuls only where
    --fp8 can run (on CPU it warns and keeps plain matmuls), the fused loss only on CUDA (not when
    disabled), between fp8 GEMMs when the lm head is an active fp8 site; the log line says which."""
    from track_1_short.model.fp8 import Fp8Matmuls, PlainMatmuls
    from track_1_short.model.fp8_config import Fp8Config
    from track_1_short.trainer import build

    model = _model(fp8=Fp8Config(enabled=True))
    with pytest.warns(UserWarning, match="fp8 matmuls cannot run on cpu"):
        build.prepare_for_device(model, torch.device("cpu"))
    assert type(model.matmuls) is PlainMatmuls and model.head_loss is None
    assert build.describe_strategies(model) == "training forward: bf16/fp32 matmuls, torch (model/loss.py) loss"
    pytest.importorskip("triton")
    build._install_fused_loss(model, torch.device("cuda"), enabled=False)
    assert model.head_loss is None
    build._install_fused_loss(model, torch.device("cuda"), enabled=True)
    from track_1_short.kernels.softcap_ce import DEFAULT_LAUNCH, linear_softcap_ce
    assert model.head_loss.func is linear_softcap_ce and model.head_loss.keywords["launch"] == DEFAULT_LAUNCH
    assert build.describe_strategies(model).endswith("fused Triton kernel (kernels/softcap_ce.py) loss")
    build._install_fused_loss(model, torch.device("cuda"), enabled=True, schedule="one_pass")
    assert model.head_loss.keywords["launch"].one_pass
    assert build.describe_strategies(model).endswith("(kernels/softcap_ce.py) in one pass loss")
    with pytest.raises(ValueError, match="recompute needs the fp8 lm head"):
        build._install_fused_loss(model, torch.device("cuda"), enabled=True, schedule="recompute")
    model.head_loss = None
    model.matmuls = Fp8Matmuls(model.config.fp8, num_layers=model.config.num_layers)
    build._install_fused_loss(model, torch.device("cuda"), enabled=True)
    from track_1_short.kernels.softcap_ce_fp8 import linear_softcap_ce_fp8
    head = model.head_loss  # an fp8 lm head: the same kernel between fp8 GEMMs, its static scales
    assert head.func is linear_softcap_ce_fp8
    assert head.keywords["x_s"] is model.matmuls.lm_head_x_scale
    assert head.keywords["w_s"] is model.matmuls.lm_head_w_scale
    assert head.keywords["grad_s"] is model.matmuls.lm_head_grad_scale
    from track_1_short.kernels.softcap_ce import RECOMPUTE_LAUNCH
    assert head.keywords["launch"] == RECOMPUTE_LAUNCH  # "auto": recompute with the fp8 head
    assert build.describe_strategies(model) == (
        "training forward: fp8 (lm_head, mlp_up, mlp_down), otherwise bf16/fp32 matmuls, fused "
        "Triton kernel between fp8 GEMMs (kernels/softcap_ce_fp8.py) in one pass, the gradient "
        "recomputed in the backward (kernels/fp8_logit_grad.py) loss")
    build._install_fused_loss(model, torch.device("cuda"), enabled=True, schedule="two_pass")
    assert model.head_loss.func is linear_softcap_ce_fp8 and model.head_loss.keywords["launch"] == DEFAULT_LAUNCH
    assert build.describe_strategies(model).endswith("(kernels/softcap_ce_fp8.py) loss")
    mlp_only = _model(fp8=Fp8Config(enabled=True, sites=("mlp_up", "mlp_down")))
    mlp_only.matmuls = Fp8Matmuls(mlp_only.config.fp8, num_layers=mlp_only.config.num_layers)
    build._install_fused_loss(mlp_only, torch.device("cuda"), enabled=True)
    assert mlp_only.head_loss.func is linear_softcap_ce, "fp8 on the MLP only keeps the fused loss"
    assert build.describe_strategies(mlp_only) == ("training forward: fp8 (mlp_up, mlp_down), "
                                                   "otherwise bf16/fp32 matmuls, fused Triton "
                                                   "kernel (kernels/softcap_ce.py) loss")
