"""StepGraphs logic on CPU, over the CUDA-graph stand-in (capture_support.RecordingGraphBackend).

Scope: static-input copies and output aliasing, gradient handoff (ANVIL direct, Adam and
micro-step accumulators), the n-gram gradient as the graph's buffer, seal, key/YaRN guards, the self-check,
capture-error translation, the eager twin's parity and `python -O` safety. The model, n-gram
table, value-embed pull and optimizer are small FAKES with the real modules' contracts (the real
ones are exercised on the GPU by tests/test_step_graphs_gpu.py), plus one `slow` test of the real
tiny GPT's contracts over the stand-in. Hardware: CPU; ~25 s on 2 busy cores (the real-GPT test
~8 s, the `python -O` subprocess ~5 s).
Run: `.venv/bin/python -m pytest tests/test_step_graphs.py -q`.

Shapes: T tokens, V fake vocab, D width (= the fake n-gram row width).
"""

import copy
import dataclasses
import gc
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from track_1_short.data import Batch
from track_1_short.perf.cuda_graphs.capture_plan import step_keys, warmup_visit_plan
from track_1_short.perf.cuda_graphs.capture_support import (
    CaptureError, RecordingGraphBackend, StepGraphError, paused_gc)
from track_1_short.perf.cuda_graphs.step_graphs import (
    EagerStep, StepGraphs, StepGraphsConfig, StepRunner, make_step_runner, sampled_check_steps,
    training_loss)
from track_1_short.schedule import Schedule, ScheduleConfig, StageConfig, StepPlan

V, D, CACHE_ROWS = 16, 8, 32


# ---- fakes with the contracts of model/gpt.py, ngram_table.py, value_embed_pull.py, anvil.py ----

@dataclass(slots=True, kw_only=True)
class FakeForwardConfig:
    mtp_weights: Tensor  # [n]
    prefix_weight: Tensor  # 0-d
    ws_short: int
    ws_long: int
    train_max_seq_len: int


class FakeYarn(nn.Module):
    def __init__(self, attn_scale: float):
        super().__init__()
        self.attn_scale = attn_scale
        self.register_buffer("table", torch.linspace(0.5, 1.5, D))  # [D]


class FakeNgramTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.randn(CACHE_ROWS, D))  # [R, D] device row cache
        self.sinks: dict[int, Tensor] = {}

    def grad_sink(self, tokens: int) -> Tensor:
        if tokens not in self.sinks:
            self.sinks[tokens] = torch.zeros(2 * tokens, D, requires_grad=True)  # [2T, D]
        return self.sinks[tokens]


class _ValueEmbedFn(torch.autograd.Function):
    """Gathers rows forward; backward index_adds into the persistent grad_accum (no table grad)."""

    @staticmethod
    def forward(ctx, table, ids, grad_accum):
        ctx.ids, ctx.grad_accum = ids, grad_accum
        return table[ids]

    @staticmethod
    def backward(ctx, grad_out):
        ctx.grad_accum.index_add_(0, ctx.ids, grad_out)
        return None, None, None


class FakeGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.bank_qk = nn.Parameter(torch.randn(D, D) * 0.3)  # ANVIL
        self.bank_mlp = nn.Parameter(torch.randn(D, D) * 0.3)  # ANVIL
        self.embed = nn.Parameter(torch.randn(V, D))  # Adam
        self.gates = nn.Parameter(torch.ones(3))  # Adam
        self.value_embed = nn.Parameter(torch.randn(V, D) * 0.1)  # Adam, grad via grad_accum
        self.ngram = FakeNgramTable()
        self.yarn, self.yarn_paired_head, self.yarn_wide = FakeYarn(0.1), FakeYarn(0.1), FakeYarn(0.12)
        self.register_buffer("fp8_scale", torch.ones(()))

    def forward(self, inputs, targets, cum_seqlens, ngram_slots, cfg, *, ngram_sink,
                value_embed_grad, embed_grad=None):
        T = inputs.numel()
        ids = inputs.long()
        rows = self.ngram.cache[ngram_slots.long()] + ngram_sink  # [2T, D]
        embed = self.embed[ids] if embed_grad is None else _ValueEmbedFn.apply(self.embed, ids, embed_grad)
        x = embed + rows[:T] + rows[T:]  # [T, D]
        x = x + _ValueEmbedFn.apply(self.value_embed, ids, value_embed_grad)
        doc = torch.searchsorted(cum_seqlens, torch.arange(T, dtype=cum_seqlens.dtype), right=True)
        x = x * (1 + 0.01 * doc.unsqueeze(1).float()) * self.yarn.table
        h = torch.tanh(x @ self.bank_qk * (10 * self.yarn_wide.attn_scale))
        h = torch.relu(h @ self.mlp_weight()) * self.gates[0] + x * self.gates[1]
        logits = (h @ self.embed.T) * self.gates[2] * self.fp8_scale  # [T, V]
        ce = F.cross_entropy(logits, targets, reduction="none")  # [T]
        loss = ce * cfg.mtp_weights[0]
        for k in range(1, cfg.mtp_weights.numel()):
            loss = loss + cfg.mtp_weights[k] * torch.roll(ce, -k)
        return loss + cfg.prefix_weight * ce  # [T]

    def mlp_weight(self):
        return self.bank_mlp


class BakingGPT(FakeGPT):
    """Stands in for a graph that baked an input's value: inside a "graph" (the stand-in capture and
    its replays, see BakingBackend) it uses the targets of its first call; the self-check's eager
    forward, outside any graph, reads the live buffer."""

    baked = None
    in_graph = False

    def forward(self, inputs, targets, *args, **kwargs):
        if self.in_graph:
            if self.baked is None:
                self.baked = targets.clone()
            targets = self.baked
        return super().forward(inputs, targets, *args, **kwargs)


class GradBakingGPT(FakeGPT):
    """Stands in for a graph whose backward is wrong while its forward is right (measured on torch
    2.11: varlen_attn replays wrong gradients): inside a "graph" the gradient of bank_mlp is halved
    (w*0.5 + (w*0.5).detach() has w's value and half its gradient)."""

    in_graph = False

    def mlp_weight(self):
        w = self.bank_mlp
        return w * 0.5 + (w * 0.5).detach() if self.in_graph else w


class PullBakingGPT(FakeGPT):
    """Stands in for a graph whose backward adds a wrong gradient into a pulled buffer (the loss
    and every .grad right): inside a "graph" the rows pulled for `pulled` ("value_embed" or
    "embed") pass half their gradient to the buffer."""

    in_graph = False
    pulled = "value_embed"

    def forward(self, inputs, targets, cum_seqlens, ngram_slots, cfg, *, ngram_sink,
                value_embed_grad, embed_grad=None):
        original = _ValueEmbedFn.apply

        def halved(table, ids, grad_accum):
            rows = original(table, ids, grad_accum)
            if self.in_graph and table is getattr(self, self.pulled):
                return rows * 0.5 + (rows * 0.5).detach()
            return rows
        _ValueEmbedFn.apply = halved
        try:
            return super().forward(inputs, targets, cum_seqlens, ngram_slots, cfg,
                                   ngram_sink=ngram_sink, value_embed_grad=value_embed_grad,
                                   embed_grad=embed_grad)
        finally:
            _ValueEmbedFn.apply = original


class BakingBackend(RecordingGraphBackend):
    """Marks the model as inside a graph while the captured forward runs (capture and replays)."""

    def __init__(self, model: BakingGPT):
        self.model = model

    def capture_pair(self, forward, backward, loss_fn, leaves, **kw):
        def in_graph_loss():
            self.model.in_graph = True
            try:
                return loss_fn()
            finally:
                self.model.in_graph = False

        return super().capture_pair(forward, backward, in_graph_loss, leaves, **kw)


class FakeValueEmbeds:
    def __init__(self):
        self.grad_accum = torch.zeros(V, D)  # [V, D]


class FakeNgramStore:
    """NgramStore's rows-inside-the-step contract (pull_, accumulate_, baked_tensors) over the
    fake lookup: the slots are a fixed function of the inputs (fake_slots), the held gradients
    are summed per cache slot into `acc`."""

    rows_in_step = True

    def __init__(self):
        self.acc = torch.zeros(CACHE_ROWS, D)  # [R, D]
        self.pulls = 0

    def pull_(self, inputs: Tensor, ids_out: Tensor, slots_out: Tensor) -> None:
        self.pulls += 1
        slots_out.copy_(fake_slots(inputs))
        ids_out.copy_(slots_out)

    def accumulate_(self, grad: Tensor, ids: Tensor) -> None:
        self.acc.index_add_(0, ids, grad)

    def baked_tensors(self):
        yield "ngram_store.acc", self.acc


def fake_slots(inputs: Tensor) -> Tensor:
    """[T] tokens -> [2T] cache slots (the fake store's hash)."""
    t = inputs.long()
    return torch.cat([(3 * t + 1) % CACHE_ROWS, (5 * t + torch.roll(t, 1)) % CACHE_ROWS])


class FakeOptimizer:
    def __init__(self, model: FakeGPT):
        anvil, adam = SimpleNamespace(optim="anvil"), SimpleNamespace(optim="adam")
        self.param_cfgs = {model.bank_qk: anvil, model.bank_mlp: anvil, model.embed: adam,
                           model.gates: adam, model.value_embed: adam}


# ---- a tiny 4-key schedule and a harness ----

def _stage(name, num_steps, tokens, cu, ws, mtp_start, mtp_end, extension=False):
    return StageConfig(name=name, num_steps=num_steps, tokens_per_rank=tokens, ws_short=ws[0],
                       ws_long=ws[1], max_seq_len=tokens, cu_seqlens_rows=cu,
                       mtp_weights_start=mtp_start, mtp_weights_end=mtp_end,
                       prefix_weight_start=0.25, prefix_weight_end=0.0, lr_mul=1.0,
                       extension=extension)


TINY = Schedule(ScheduleConfig(stages=(
    _stage("A", 6, 16, 4, (128, 384), (1.0, 0.5, 0.25), (1.0, 0.5, 0.0)),
    _stage("B", 6, 24, 5, (384, 896), (1.0, 0.5), (1.0, 0.0)),
    _stage("C", 4, 32, 6, (640, 1408), (1.0,), (1.0,)),
    _stage("D", 3, 32, 6, (768, 1664), (1.0,), (1.0,), extension=True),
)))
MAX_TOKENS = 32
TINY_PLANS = [TINY.plan(step) for step in range(TINY.num_steps)]


def make_batch(plan: StepPlan, seed: int, tokens: int | None = None) -> tuple[Batch, Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = tokens or plan.tokens_per_rank
    inner = torch.randperm(T - 1, generator=g)[:plan.cu_seqlens_rows - 2].sort().values + 1
    cum = torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.tensor([T])]).int()  # [C]
    batch = Batch(inputs=torch.randint(0, V, (T,), generator=g, dtype=torch.int32),
                  targets=torch.randint(0, V, (T,), generator=g), cum_seqlens=cum)
    return batch, torch.randint(0, CACHE_ROWS, (2 * T,), generator=g)  # ngram_slots [2T]


def make_cfg(plan: StepPlan) -> FakeForwardConfig:
    return FakeForwardConfig(mtp_weights=torch.tensor(plan.mtp_weights),
                             prefix_weight=torch.tensor(plan.prefix_weight),
                             ws_short=plan.ws_short, ws_long=plan.ws_long,
                             train_max_seq_len=plan.max_seq_len)


class Harness:
    def __init__(self, model_cls=FakeGPT, graphs=True, micro_steps=1, store=None,
                 embed_grad=False, **config):
        torch.manual_seed(0)
        self.model = model_cls()
        self.store = store  # a FakeNgramStore: the rows inside the step
        self.value_embeds = FakeValueEmbeds()
        # the token embedding's pulled gradient (TrainConfig.embed_grad "pull"), else dense
        self.embed_grad = torch.zeros(V, D) if embed_grad else None  # [V, D]
        self.keys = step_keys(TINY)
        config = StepGraphsConfig(**{"mode": "on" if graphs else "off", "warm_iterations": 1,
                                     **config})
        self.runner = make_step_runner(
            config, model=self.model, optimizer=FakeOptimizer(self.model), step_keys=self.keys,
            ngram_table=self.model.ngram, value_embeds=self.value_embeds,
            max_step_tokens=MAX_TOKENS, plans=TINY_PLANS, micro_steps=micro_steps,
            backend=(BakingBackend(self.model) if hasattr(model_cls, "in_graph")
                     else RecordingGraphBackend()), ngram_store=store, embed_grad=self.embed_grad)

    def step(self, step: int, seed: int | None = None, micro_step: int = 0, **batch_kw):
        """One train_step's runner calls; returns (loss value, the n-gram gradient as read right
        after the backward, as NgramStore.hold reads it)."""
        plan = TINY.plan(step)
        batch, slots = make_batch(plan, step * 100 + micro_step if seed is None else seed, **batch_kw)
        if self.store is not None:
            slots = None  # the runner pulls them
        loss = self.runner.forward(step, batch, slots, make_cfg(plan), micro_step=micro_step)
        value = loss.item()  # the graph's loss is overwritten by the next replay: read it now
        grad = self.runner.backward()
        return value, None if grad is None else grad.clone()

    def warmup_and_seal(self):
        for step in warmup_visit_plan(TINY):
            self.step(step)
        self.runner.seal()


def reference_grads(model: FakeGPT, step: int, seed: int | None = None) -> dict[str, Tensor]:
    """Gradients of one step on a copy of the model (autograd, no runner)."""
    model = copy.deepcopy(model)
    plan = TINY.plan(step)
    batch, slots = make_batch(plan, step * 100 if seed is None else seed)
    sink = torch.zeros(2 * plan.tokens_per_rank, D, requires_grad=True)
    loss = training_loss(model, batch.inputs, batch.targets, batch.cum_seqlens, slots,
                         make_cfg(plan), sink, torch.zeros(V, D))
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


# ---- tests ----

def test_replay_reads_new_batch_and_overwrites_kept_loss():
    h = Harness()
    plan = TINY.plan(0)
    batch0, slots0 = make_batch(plan, 1)
    kept = h.runner.forward(0, batch0, slots0, make_cfg(plan))
    first = kept.item()
    h.runner.backward()
    batch1, slots1 = make_batch(plan, 2)
    again = h.runner.forward(2, batch1, slots1, make_cfg(TINY.plan(2)))
    h.runner.backward()
    assert again is kept  # one output address per key
    with torch.no_grad():
        eager = training_loss(h.model, batch1.inputs, batch1.targets, batch1.cum_seqlens, slots1,
                              make_cfg(TINY.plan(2)), h.model.ngram.sinks[16], torch.zeros(V, D))
    assert kept.item() == pytest.approx(eager.item(), rel=1e-6) and kept.item() != first


def test_anvil_grad_is_the_graph_buffer():
    h = Harness()
    h.step(0)
    cs = h.runner.captured[h.keys[0]]
    graph_grads = {id(p): g for p, g in cs.grads}
    bank = h.model.bank_qk
    assert bank.grad is graph_grads[id(bank)]
    ptr, before = bank.grad.data_ptr(), bank.grad.clone()
    h.step(1)
    assert bank.grad.data_ptr() == ptr and not torch.equal(bank.grad, before)
    torch.testing.assert_close(bank.grad, reference_grads(h.model, 1)["bank_qk"])


def test_adam_copy_then_add_with_stable_accumulator():
    h = Harness()
    ref = [reference_grads(h.model, s) for s in range(3)]  # params do not change: no optimizer
    h.step(0)
    acc = h.model.embed.grad
    ptr = acc.data_ptr()
    torch.testing.assert_close(acc, ref[0]["embed"])
    h.step(1)
    assert h.model.embed.grad is acc and acc.data_ptr() == ptr
    torch.testing.assert_close(acc, ref[0]["embed"] + ref[1]["embed"])
    torch.testing.assert_close(h.model.gates.grad, ref[0]["gates"] + ref[1]["gates"])
    h.model.embed.grad = None  # an optimizer that clears .grad does not change the cadence
    h.step(2)
    assert h.model.embed.grad is acc
    torch.testing.assert_close(acc, ref[2]["embed"])
    assert h.model.value_embed.grad is None  # its gradient goes to grad_accum
    assert h.value_embeds.grad_accum.abs().sum() > 0


def test_micro_steps_accumulate_anvil_grads():
    h = Harness(micro_steps=2)
    h.step(0, micro_step=0)
    g0 = h.model.bank_qk.grad.clone()
    h.step(0, micro_step=1)
    assert not any(h.model.bank_qk.grad is g for _, g in h.runner.captured[h.keys[0]].grads)
    # each micro-step's loss is scaled by 1 / micro_steps (training_loss's grad_scale)
    torch.testing.assert_close(g0, 0.5 * reference_grads(h.model, 0, seed=0)["bank_qk"])
    torch.testing.assert_close(h.model.bank_qk.grad,
                               g0 + 0.5 * reference_grads(h.model, 0, seed=1)["bank_qk"])
    with pytest.raises(StepGraphError, match="micro_step 2"):
        h.step(0, micro_step=2)


def test_ngram_gradient_is_the_graph_buffer_until_the_next_replay():
    """backward() hands out the key's own buffer (no copy); the next replay of the key rewrites
    it, which is why NgramStore.hold sums it into the row accumulator at once."""
    h = Harness()
    h.step(1)
    cs = h.runner.captured[h.keys[1]]
    plan = TINY.plan(3)
    batch, slots = make_batch(plan, 300)
    h.runner.forward(3, batch, slots, make_cfg(plan))
    kept = cs.ngram_grad.clone()
    assert h.runner.backward() is cs.ngram_grad and cs.ngram_grad.shape == (2 * 16, D)
    h.step(3, seed=7)  # the same key, another batch: the replay rewrites the buffer
    assert not torch.equal(cs.ngram_grad, kept)


def _slot_sums(held: list[tuple[Tensor, Tensor]]) -> Tensor:
    """What the store's accumulator holds after these (slots [2T], sink gradient [2T, D])."""
    acc = torch.zeros(CACHE_ROWS, D)
    for slots, grad in held:
        acc.index_add_(0, slots, grad)
    return acc


@pytest.mark.parametrize("graphs", [True, False])
def test_rows_in_the_step_pull_and_hold_inside_the_runner(graphs):
    """With the store given, the runner pulls the rows from the live inputs at the head of every
    forward (inside the forward graph: the captured pull runs at each replay) and adds the sink
    gradient into the store at the tail of every backward, once per micro-step; losses equal the
    slots-from-outside path with the same slots, and the accumulator equals the sum of that path's
    held gradients."""
    store = FakeNgramStore()
    inside, outside = Harness(graphs=graphs, store=store), Harness(graphs=graphs)
    steps = [0, 1, 0, 6]  # key A captured, replayed, replayed; key B captured (graphs)
    held = []
    for i, step in enumerate(steps):
        plan = TINY.plan(step)
        batch, _ = make_batch(plan, 50 + i)
        loss_in = inside.runner.forward(step, batch, None, make_cfg(plan)).item()
        assert inside.runner.backward() is None  # already in the store
        slots = fake_slots(batch.inputs)
        loss_out = outside.runner.forward(step, batch, slots, make_cfg(plan)).item()
        held.append((slots, outside.runner.backward().clone()))
        assert loss_in == pytest.approx(loss_out, rel=1e-6), step
    # the stand-in's capture runs the step once more than a real one (keys A and B), the
    # warm iterations and the self-check's eager passes add nothing
    extra = [held[0], held[3]] if graphs else []
    torch.testing.assert_close(store.acc, _slot_sums(held + extra))
    # pulls with graphs: key A's warm iteration, capture and replay; its replay and the
    # self-check's two eager forwards; a replay; key B's warm iteration, capture and replay
    assert store.pulls == (3 + 3 + 1 + 3 if graphs else len(steps))
    roles = [role for role, _ in inside.runner.baked_tensors()]
    assert ("ngram_store.acc" in roles) == graphs
    assert "ngram_store.acc" not in [role for role, _ in outside.runner.baked_tensors()]


def test_rows_mode_mismatch_is_an_error():
    """Slots from outside to a runner that pulls them (or none to one that does not) would
    silently read the wrong rows: both are errors naming the setting."""
    plan = TINY.plan(0)
    batch, slots = make_batch(plan, 1)
    for graphs in (True, False):
        with pytest.raises(StepGraphError, match="ngram_rows_in_step"):
            Harness(graphs=graphs, store=FakeNgramStore()).runner.forward(0, batch, slots, make_cfg(plan))
        with pytest.raises(StepGraphError, match="ngram_rows_in_step"):
            Harness(graphs=graphs).runner.forward(0, batch, None, make_cfg(plan))


def test_seal_missing_and_unchecked_keys_are_fatal():
    h = Harness()
    h.step(0)
    with pytest.raises(StepGraphError, match=r"never captured.*tokens=24"):
        h.runner.seal()
    h = Harness()
    for step in (0, 1, 6, 7, 12, 13, 16):
        h.step(step)
    with pytest.raises(StepGraphError, match=r"never self-checked.*ws_long=1664"):
        h.runner.seal()
    h.step(17)
    h.runner.seal()


def test_unplanned_shape_after_seal_names_the_key():
    h = Harness()
    h.warmup_and_seal()
    h.step(3)
    with pytest.raises(StepGraphError, match=r"step 3: live key .*tokens=20.* != schedule key"):
        h.step(3, tokens=20)
    with pytest.raises(StepGraphError, match="outside the planned training steps"):
        h.runner.forward(19, *make_batch(TINY.plan(18), 0), make_cfg(TINY.plan(18)))


def test_yarn_scale_change_after_capture_raises():
    h = Harness()
    h.step(0)
    h.model.yarn_wide.attn_scale = 0.13
    with pytest.raises(StepGraphError, match=r"step 1.*YaRN attention scales .*0\.13.* != captured"):
        h.step(1)


def test_self_check_catches_a_baked_value():
    h = Harness(model_cls=BakingGPT)
    h.step(0)
    with pytest.raises(StepGraphError, match=r"step 1: step graph .* replay loss .* != eager"):
        h.step(1)


def test_self_check_catches_wrong_gradients_with_a_right_loss():
    h = Harness(model_cls=GradBakingGPT)
    h.step(0)
    with pytest.raises(StepGraphError, match=r"step 1: step graph .* gradient of bank_mlp .*"
                                             r"relative error 0\.5"):
        h.step(1)


@pytest.mark.parametrize("pulled,name", [("value_embed", "value_embeds.grad_accum"),
                                         ("embed", "embed_grad_accum")])
def test_self_check_catches_a_wrong_pulled_gradient(pulled, name):
    """The gradient a captured backward adds into a pulled buffer (value embeddings, the token
    embedding with TrainConfig.embed_grad "pull") is compared with the eager backward's addition."""
    model_cls = type("Pull", (PullBakingGPT,), {"pulled": pulled})
    h = Harness(model_cls=model_cls, embed_grad=pulled == "embed")
    h.step(0)
    with pytest.raises(StepGraphError, match=rf"step 1: step graph .* gradient of {name} .*"
                                             r"relative error 0\.5"):
        h.step(1)


def test_self_check_leaves_the_pulled_buffers_with_the_replays_addition_only():
    """After the key's first check the pulled buffers hold what the replay added (the eager
    backward's addition is taken back), as on an unchecked replay."""
    h = Harness(embed_grad=True)
    h.step(0)  # capture
    buffers = (h.value_embeds.grad_accum, h.embed_grad)
    for b in buffers:
        b.zero_()
    h.step(1)  # the first replay of the key, checked
    model = copy.deepcopy(h.model)
    plan = TINY.plan(1)
    batch, slots = make_batch(plan, 100)
    expected = [torch.zeros(V, D), torch.zeros(V, D)]
    training_loss(model, batch.inputs, batch.targets, batch.cum_seqlens, slots, make_cfg(plan),
                  torch.zeros(2 * plan.tokens_per_rank, D, requires_grad=True), expected[0],
                  embed_grad=expected[1]).backward()
    assert h.runner.capture_report()[0]["self_checks"] == 1
    for b, e in zip(buffers, expected):
        assert e.abs().sum() > 0
        torch.testing.assert_close(b, e)


def test_self_check_records_gradient_error():
    h = Harness()
    h.warmup_and_seal()
    errors = [row["max_grad_rel_err"] for row in h.runner.capture_report()]
    assert errors and all(e is not None and e < 1e-6 for e in errors), errors


def test_self_check_passes_and_check_mode_samples_timed_steps():
    h = Harness(mode="check", check_fraction=1.0)
    h.warmup_and_seal()
    stats = h.runner.stats[h.keys[0]]
    assert stats.self_checks == 1 and stats.replay_ms is not None
    h.step(2)
    h.step(3)
    assert stats.self_checks == 3
    assert sampled_check_steps(1000, 0.1, 7) == sampled_check_steps(1000, 0.1, 7)
    assert 50 < len(sampled_check_steps(1000, 0.1, 7)) < 150


def test_capture_report_rows():
    h = Harness()
    h.warmup_and_seal()
    rows = h.runner.capture_report()
    assert [row["key"]["tokens"] for row in rows] == [16, 24, 32, 32]
    assert [row["steps_served"] for row in rows] == [6, 6, 4, 3]
    for row in rows:
        assert row["capture_s"] > 0 and row["pool_mib_added"] is None
        assert row["eager_ms"] > 0 and row["replay_ms"] > 0 and row["self_checks"] == 1


def test_capture_error_names_key_and_host_sync():
    backend = RecordingGraphBackend()

    def loss_fn():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with pytest.raises(CaptureError, match=r"forward of step graph KEY-A .*host sync.*\.item\(\)"):
        backend.capture_pair(backend.new_graph(), backend.new_graph(), loss_fn, [], pool=None,
                             stream=None, key="KEY-A")
    with pytest.raises(RuntimeError, match="unrelated") as info:
        backend.capture_pair(backend.new_graph(), backend.new_graph(),
                             lambda: (_ for _ in ()).throw(RuntimeError("unrelated")), [],
                             pool=None, stream=None, key="KEY-A")
    assert not isinstance(info.value, CaptureError)


def test_paused_gc_restores_state():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("embed_grad", [False, True], ids=["dense_embed", "pulled_embed"])
def test_eager_twin_matches_graphs(embed_grad):
    graphs, eager = Harness(embed_grad=embed_grad), Harness(graphs=False, embed_grad=embed_grad)
    assert isinstance(graphs.runner, StepGraphs) and isinstance(eager.runner, EagerStep)
    assert isinstance(graphs.runner, StepRunner) and isinstance(eager.runner, StepRunner)
    assert list(eager.runner.baked_tensors()) == [] and eager.runner.capture_report() == []
    visits = warmup_visit_plan(TINY)
    for step in visits + [2, 3, 8, 9]:
        if step == 2:  # the timed run starts after the warmup and its in-place reset
            for h in (graphs, eager):
                # warm iterations and capture also added into grad_accum (graphs only)
                h.value_embeds.grad_accum.zero_()
                if embed_grad:
                    h.embed_grad.zero_()
                h.runner.seal()
        loss_g, held_g = graphs.step(step)
        loss_e, held_e = eager.step(step)
        assert loss_g == pytest.approx(loss_e, rel=1e-6)
        torch.testing.assert_close(held_g, held_e)
        for (name, pg), pe in zip(graphs.model.named_parameters(), eager.model.parameters()):
            assert (pg.grad is None) == (pe.grad is None), name
            if pg.grad is not None:
                torch.testing.assert_close(pg.grad, pe.grad, msg=name)
    torch.testing.assert_close(graphs.value_embeds.grad_accum, eager.value_embeds.grad_accum)
    if embed_grad:
        assert graphs.embed_grad.abs().sum() > 0
        torch.testing.assert_close(graphs.embed_grad, eager.embed_grad)


def test_pulled_embed_gradient_equals_dense():
    """TrainConfig.embed_grad "pull" through the captured step: the embedding's gradient (the
    fake's head use stays in .grad) plus what its backward added into the buffer is the dense
    gradient, micro-step after micro-step; the buffer is censused."""
    h = Harness(micro_steps=2, embed_grad=True)
    h.warmup_and_seal()
    h.embed_grad.zero_()
    dense = [reference_grads(h.model, 2, seed=seed)["embed"] for seed in (7, 8)]
    for micro_step, seed in enumerate((7, 8)):
        h.step(2, seed=seed, micro_step=micro_step)
    assert TINY_PLANS[2].adam_first  # the handoff's window opens at micro-step 0
    pulled = h.model.embed.grad + h.embed_grad  # the handoff summed the head part over both
    torch.testing.assert_close(pulled, (dense[0] + dense[1]) / 2)  # loss scale 1 / micro_steps
    assert h.embed_grad.abs().sum() > 0
    assert "embed_grad_accum" in [role for role, _ in h.runner.baked_tensors()]


def test_config_validation():
    with pytest.raises(ValueError, match="--graphs"):
        StepGraphsConfig(mode="maybe")
    with pytest.raises(ValueError, match="check_fraction"):
        StepGraphsConfig(check_fraction=2.0)
    with pytest.raises(ValueError, match="warm_iterations"):
        StepGraphsConfig(warm_iterations=0)


def test_guards_survive_python_O():
    script = (
        "import torch\n"
        "from track_1_short.data import Batch\n"
        "from track_1_short.perf.cuda_graphs.capture_plan import StepGraphKey\n"
        "from track_1_short.perf.cuda_graphs.step_graphs import StepGraphError, check_key\n"
        "from types import SimpleNamespace as NS\n"
        "assert False  # stripped under -O\n"
        "b = Batch(torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int64),\n"
        "          torch.zeros(3, dtype=torch.int32))\n"
        "cfg = NS(mtp_weights=torch.ones(1), ws_short=128, ws_long=256, train_max_seq_len=8)\n"
        "try:\n"
        "    check_key(0, b, cfg, [StepGraphKey(16, 3, 1, 128, 256, 8)])\n"
        "except StepGraphError as e:\n"
        "    print('raised:', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert "raised: step 0: live key" in out.stdout


def test_static_roles_in_baked_tensors():
    h = Harness()
    h.step(0)
    roles = [role for role, _ in h.runner.baked_tensors()]
    assert "value_embeds.grad_accum" in roles and "ngram_table.sinks[16]" in roles
    assert "grad_accumulator[embed]" in roles  # (no n-gram ring: the store reads the sink gradient)
    tag = "step_graph" + str(tuple(h.keys[0]))
    assert {f"{tag}.{f}" for f in ("inputs", "targets", "cum_seqlens", "ngram_slots",
                                   "mtp_weights", "prefix_weight")} <= set(roles)
    assert len(roles) == len(set(roles))
    assert dataclasses.is_dataclass(h.runner.captured[h.keys[0]].static)


@pytest.mark.slow
def test_real_tiny_gpt_contract_on_cpu():
    """The real GPT (GPTConfig.tiny(), reference attention) through StepGraphs over the stand-in
    and through EagerStep: the module contracts (forward signature, grad_sink, grad_accum, the
    three YaRN instances, ForwardScheduleConfig) hold, and the two runners agree."""
    gpt = pytest.importorskip("track_1_short.model.gpt")
    ngram = pytest.importorskip("track_1_short.model.ngram_config")
    from track_1_short.optim.anvil_config import build_param_cfgs
    from track_1_short.perf.ngram_store import NgramStore
    stages = (_stage("A", 2, 128, 4, (128, 128), (1.0, 0.5), (1.0, 0.0)),)
    schedule = Schedule(ScheduleConfig(stages=stages))
    keys = step_keys(schedule)
    losses = {}
    for graphs in (True, False):
        torch.manual_seed(0)
        model = gpt.GPT(gpt.GPTConfig.tiny(
            vocab_size=V, num_layers=3, long_window_layers=(2,), paired_head_layers=(0,),
            no_attention_layer=None, skip_from_layer=0, value_embed_layers=(1,),
            ngram=ngram.NgramConfig(dim=128, vocab_size=V, bigram_rows=64, trigram_rows=64,
                                    cache_rows=256, bos_id=V - 1)))
        model.resolve_attention_backend(torch.device("cpu"))
        optimizer = SimpleNamespace(param_cfgs=build_param_cfgs(model.named_parameters()))
        store = NgramStore(model.ngram_table, cycle=schedule.cfg.ngram_cycle, micro_steps=1)
        runner = make_step_runner(
            StepGraphsConfig(mode="on" if graphs else "off", warm_iterations=1), model=model,
            optimizer=optimizer, step_keys=keys, ngram_table=model.ngram_table,
            value_embeds=model.value_embeds, max_step_tokens=128,
            plans=[schedule.plan(s) for s in range(schedule.num_steps)], micro_steps=1,
            backend=RecordingGraphBackend())
        for step in (0, 1):
            plan = schedule.plan(step)
            batch, _ = make_batch(plan, step)
            cfg = gpt.ForwardScheduleConfig(
                mtp_weights=torch.tensor(plan.mtp_weights),
                prefix_weight=torch.tensor(plan.prefix_weight),
                ws_short=plan.ws_short, ws_long=plan.ws_long, train_max_seq_len=plan.max_seq_len)
            loss = runner.forward(step, batch, store.slots_for(batch.inputs), cfg)
            losses.setdefault(step, []).append(loss.item())
            runner.backward()
        runner.seal()
        losses.setdefault("qk_grad", []).append(model.qk_bank.grad.clone())
    assert losses[0][0] == pytest.approx(losses[0][1], rel=1e-5)
    assert losses[1][0] == pytest.approx(losses[1][1], rel=1e-5)
    torch.testing.assert_close(*losses["qk_grad"])
