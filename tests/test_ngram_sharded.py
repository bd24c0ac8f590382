"""Sharded NgramStore (rows split over ranks, row pull and update events through all_to_all_single),
RowPrefetch and ValueEmbedPull's grad_accum under AnvilAndAdam, across processes with gloo on CPU.

Scope: W = 2 and 4 ranks, each running 8/W micro-steps on its slices of the same global batch
(8 slices per step, loss scaled by 1/micro_steps as training_loss does), give the per-slice losses,
the per-slice sink gradients, the updated table rows, the Adam state and the value-embedding weights
one process gets with 8 micro-steps (float64 n-gram path: 1e-12; float32 value embeds: 1e-5), over
6 steps with 3 update events, with the row ids of every next micro-batch prefetched between
"forward" and "backward" (so step s+1's ids are exchanged before step s's event: the test that the
row payload is not stale). Also: addresses of the row cache, sinks, the row accumulator, master slice,
Adam state and grad_accum across steps, events and a reset; bad inputs (token id >= vocab, batch larger
than the cache, world size not dividing the rows) raise ValueError naming the value; RowPrefetch on
one rank; the bench/row_prefetch.py --smoke mode.
Hardware: CPU only, spawns processes (~30 s on 2 cores).
Run: `.venv/bin/python -m pytest tests/test_ngram_sharded.py -q`.
"""

import functools
import json
import sys
from pathlib import Path

from dataclasses import dataclass

import pytest

from tests.mp_utils import free_port, gloo_worker, single_thread
import torch
import torch.multiprocessing as mp
from torch import nn

from track_1_short.model.tokens import BOS_ID
from track_1_short.model.ngram_config import NgramConfig
from track_1_short.model.ngram_lookup import NgramLookup
from track_1_short.optim.anvil import AnvilAndAdam, AnvilConfig, build_param_cfgs
from track_1_short.model.value_embed import ValueEmbedPull
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.perf.row_prefetch import LookaheadLoader, RowPrefetch
from track_1_short.schedule import Schedule, ScheduleConfig

REPO = Path(__file__).resolve().parents[1]
SLICES, T, DIM, STEPS, CYCLE, VE_VOCAB = 8, 16, 8, 6, 2, 26
SCHEDULE = Schedule(ScheduleConfig(ngram_cycle=CYCLE))  # the cadences: plan(step)


def _cfg(**kw) -> NgramConfig:
    base = dict(dim=DIM, bigram_rows=100, trigram_rows=92, cache_rows=2 * T, dtype=torch.float64,
                lr=0.05)
    base.update(kw)
    return NgramConfig(**base)


def _store(cfg: NgramConfig, micro_steps: int = 1) -> NgramStore:
    return NgramStore(NgramLookup(cfg), cycle=CYCLE, micro_steps=micro_steps)


def _slice_tokens(step: int, slice_index: int) -> torch.Tensor:
    """Slice `slice_index` of step `step`'s global batch: few distinct tokens, so ranks share rows."""
    g = torch.Generator().manual_seed(1000 * step + slice_index)
    x = torch.randint(0, 12, (T,), generator=g, dtype=torch.int32)
    x[0] = BOS_ID
    x[T // 2 + slice_index % 3] = BOS_ID
    return x


class _Loader:
    """Stands in for BatchLoader: this rank's slices of every step, in order."""

    def __init__(self, rank: int, micro_steps: int):
        self.order = [(s, rank * micro_steps + m) for s in range(STEPS + 1) for m in range(micro_steps)]

    def next_batch(self):
        step, index = self.order.pop(0)
        return _Batch(_slice_tokens(step, index), index)


@dataclass
class _Batch:
    inputs: torch.Tensor  # int32 [T]
    index: int  # slice of the global batch


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.value_embeds = ValueEmbedPull(2, VE_VOCAB, DIM)  # 52 rows: sharded over 2 and 4 ranks


def _micro_loss(lookup: NgramLookup, model: _Model, slots, inputs, index: int, scale: float):
    """A nonlinear loss of the gathered rows (so a stale row changes loss and gradient) plus a value
    embedding term feeding grad_accum. Returns the scaled 0-d loss, its n-gram part, the sink."""
    sink = lookup.grad_sink(T)
    out = lookup.gather(slots, sink)  # [T, R]
    w = torch.linspace(-1, 1, T * DIM, dtype=torch.float64).view(T, DIM) * (index + 1)
    ve = model.value_embeds.lookup(index % 2, inputs.long() % VE_VOCAB, model.value_embeds.grad_accum)
    ngram_loss = (torch.tanh(out) * w).sum() + 0.1 * (out ** 2).sum()
    return (ngram_loss + ve.double().pow(2).sum()) * scale, ngram_loss.detach(), sink


def train(rank: int, world_size: int, group=None, update: str = "lazy") -> dict:
    """STEPS steps of 8/W micro-steps with row prefetch, held gradients, events, then a reset."""
    micro_steps = SLICES // world_size
    g = torch.Generator().manual_seed(7)
    table = _store(_cfg(update=update), micro_steps)
    lookup = table.lookup
    table.table.copy_(torch.randn(table.table.shape, generator=g, dtype=torch.float64))
    table.shard(rank, world_size, group)
    torch.manual_seed(0)  # ValueEmbedPull draws its init from the global generator
    model = _Model()
    opt = AnvilAndAdam(build_param_cfgs(model.named_parameters()), AnvilConfig())
    opt.set_grad_buffer(model.value_embeds.weight, model.value_embeds.grad_accum)
    prefetch, loader = RowPrefetch(table), LookaheadLoader(_Loader(rank, micro_steps))
    out = {"loss": {}, "grad": {}, "ptrs": []}

    def ptrs():
        return [t.data_ptr() for t in (lookup.cache, table.table, table.exp_avg, table.exp_avg_sq,
                                       lookup.grad_sink(T), model.value_embeds.grad_accum, table.grad_acc)]

    for step in range(STEPS):
        plan = SCHEDULE.plan(step)
        event = plan.ngram_event
        for micro in range(micro_steps):
            batch = loader.next_batch()
            inputs, index = batch.inputs, batch.index
            ids, slots = prefetch.slots_for(inputs)  # rows (phase B), after the last event
            loss, ngram_loss, sink = _micro_loss(lookup, model, slots, inputs, index, 1.0 / micro_steps)
            prefetch.issue(loader)  # next micro-batch's ids (phase A), before the "backward"
            loss.backward()
            grad, sink.grad = sink.grad, None
            out["loss"][(step, index)] = ngram_loss.item()
            out["grad"][(step, index)] = grad * micro_steps
            table.hold(grad, ids)
            grad.fill_(float("nan"))  # as a graph's next replay rewrites it: hold has read it
        opt.step(step, 1.0 - 0.1 * step, plan.momentum, plan.adam_step)
        if event:
            table.update_event(step, lr_scale=1.0 - 0.1 * step)
        out["ptrs"].append(ptrs())
    out.update(table=table.table.clone(), exp_avg=table.exp_avg.clone(),
               exp_avg_sq=table.exp_avg_sq.clone(), num_updates=int(table.num_updates),
               ve=model.value_embeds.weight.detach().clone())
    table.reset()
    lookup.reset()
    prefetch.reset()
    out["ptrs"].append(ptrs())
    return out




@pytest.fixture(scope="module")
def single():
    return single_thread(train, 0, 1)


def _assert_addresses_stable(result: dict, tag: str):
    first = result["ptrs"][0]
    for i, p in enumerate(result["ptrs"]):
        assert p == first, f"{tag}: an address moved after step/reset {i} ({p} != {first})"


def test_single_rank_reference_moves(single):
    assert single["num_updates"] == STEPS // CYCLE
    start = torch.randn(192, DIM, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    assert (single["table"] - start).abs().max() > 1e-3, "the table never moved"
    _assert_addresses_stable(single, "1 rank")


@pytest.fixture(scope="module")
def single_dense():
    return single_thread(train, 0, 1, None, "dense")


def test_dense_update_moves_rows_the_lazy_one_keeps(single, single_dense):
    """Dense Adam moves rows after their last touch (their momentum), lazy Adam does not."""
    moved = (single_dense["table"] != single["table"]).any(1)
    assert moved.any() and not moved.all()  # rows never touched stay in both


@pytest.mark.parametrize("world_size,update", [(2, "lazy"), (4, "lazy"), (2, "dense")])
def test_sharded_matches_single_rank(world_size, update, single, single_dense, tmp_path):
    """W ranks of 8/W micro-steps equal one rank of 8, lazy and dense (NgramConfig.update: every
    owner updates its whole slice) alike."""
    single = single if update == "lazy" else single_dense
    fn = train if update == "lazy" else functools.partial(train, update=update)
    mp.spawn(gloo_worker, args=(world_size, free_port(), str(tmp_path), fn), nprocs=world_size)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    per = 192 // world_size
    for r, res in enumerate(results):
        _assert_addresses_stable(res, f"rank {r}/{world_size}")
        assert res["num_updates"] == single["num_updates"]
        for key, loss in res["loss"].items():  # (step, slice) this rank ran
            assert abs(loss - single["loss"][key]) < 1e-9 * max(1.0, abs(loss)), f"loss {key} rank {r}"
            assert torch.allclose(res["grad"][key], single["grad"][key], atol=1e-12), f"grad {key}"
        for name in ("table", "exp_avg", "exp_avg_sq"):
            ref = single[name][r * per:(r + 1) * per]
            assert torch.allclose(res[name], ref, atol=1e-12, rtol=0), f"rank {r}: {name} slice differs"
        err = ((res["ve"] - single["ve"]).norm() / single["ve"].norm()).item()
        assert err < 1e-5, f"rank {r}: value_embeds relative error {err:.2e}"
    assert sum(len(res["loss"]) for res in results) == STEPS * SLICES


def test_bad_inputs_name_the_value():
    table = _store(_cfg())
    with pytest.raises(ValueError, match="60000"):
        table.lookup.row_ids(torch.tensor([1, 60000], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_rows=32"):
        RowPrefetch(table).slots_for(torch.zeros(T + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_rows=32"):
        table.slots_for(torch.zeros(T + 1, dtype=torch.int32), torch.zeros(2 * T + 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"world size 5 .* 192 rows"):
        table.shard(0, 5)
    with pytest.raises(ValueError, match="rank 2"):
        table.shard(2, 2)


def test_row_prefetch_on_one_rank_is_local():
    table = _store(_cfg())
    table.table.normal_()
    prefetch = RowPrefetch(table)
    assert not prefetch.active
    loader = LookaheadLoader(_Loader(0, 1))
    x = prefetch.issue(loader).inputs
    assert loader.next_batch().inputs is x
    ids, slots = prefetch.slots_for(x)
    direct = _store(_cfg())
    direct.table.copy_(table.table)
    assert torch.equal(ids, direct.lookup.row_ids(x)) and torch.equal(slots, direct.slots_for(x))
    assert torch.equal(table.lookup.gather(slots), direct.lookup.gather(slots))
    with pytest.raises(RuntimeError, match="another batch"):
        prefetch.issue(loader)
        prefetch.slots_for(x)


def test_row_prefetch_with_rows_in_the_step_only_takes_the_batch():
    """rows_in_step: issue() peeks the next batch and computes no ids, slots_for() hands it over
    and returns (None, None) (the step runner pulls the rows); refused on a sharded table."""
    table = _store(_cfg())
    prefetch = RowPrefetch(table, rows_in_step=True)
    loader = LookaheadLoader(_Loader(0, 2))
    assert prefetch.slots_for(loader.next_batch().inputs) == (None, None)  # nothing pending
    x = prefetch.issue(loader).inputs
    assert loader.next_batch().inputs is x
    assert prefetch.slots_for(x) == (None, None)
    assert not table.lookup.cache.any()  # nothing pulled
    sharded = _store(_cfg())
    sharded.shard(1, 2)
    with pytest.raises(ValueError, match="one rank"):
        RowPrefetch(sharded, rows_in_step=True)


def test_bench_smoke(tmp_path):
    sys.path.insert(0, str(REPO))
    try:
        from bench import row_prefetch as bench
    finally:
        sys.path.pop(0)
    path = bench.main(["--smoke", "--out", str(tmp_path / "smoke.json")])
    data = json.loads(Path(path).read_text())
    assert data["world_size"] == 2 and data["id_exchange_ms"] >= 0 and "command" in data
