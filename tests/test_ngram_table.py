"""The n-gram embedding on one rank, the model-side NgramLookup with the trainer's NgramStore:
hashing rules (BOS boundaries), gathers and sink gradients against a dense nn.Embedding with the
same hashing (float64), update events against torch.optim.SparseAdam, address stability of cache
and sinks across steps/events/reset, bad-input errors, state_dict.

Hardware: CPU only, < 10 s. Run: `.venv/bin/python -m pytest tests/test_ngram_table.py -q`.
"""

import pytest
import torch

from track_1_short.model.tokens import BOS_ID
from track_1_short.model.ngram_config import NgramConfig
from track_1_short.model.ngram_lookup import SIGN_ROWS, NgramLookup
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.schedule import Schedule, ScheduleConfig

VOCAB = 50304


def _cfg(**kw):
    base = dict(dim=8, bigram_rows=97, trigram_rows=89, cache_rows=64, dtype=torch.float64, lr=0.01)
    base.update(kw)
    return NgramConfig(**base)


def _store(cfg: NgramConfig, cycle: int = 2) -> NgramStore:
    return NgramStore(NgramLookup(cfg), cycle=cycle, micro_steps=1)


def _tokens(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50257, (t,), generator=g, dtype=torch.int32)
    x[0] = BOS_ID
    x[t // 2] = BOS_ID
    return x


def test_bos_boundaries_use_reserved_rows():
    lookup = NgramLookup(_cfg())
    x = torch.tensor([BOS_ID, 11, 12, 13, BOS_ID, 21, 22], dtype=torch.int32)
    ids = lookup.row_ids(x)
    big, tri = ids[:7], ids[7:]
    b_none, t_none = 96, 97 + 88
    assert big.tolist()[:2] == [b_none, b_none] and big[4] == b_none and big[5] == b_none
    assert all(b < 96 for b in big[[2, 3, 6]].tolist())
    assert tri[:3].tolist() == [t_none] * 3 and tri[4:6].tolist() == [t_none] * 2
    assert 97 <= tri[3] < t_none and tri[6] == t_none  # 22: context 21 only (BOS before it)
    signs = lookup.sign_ids(x)
    assert signs[0] == 0 and signs[7] == 0


def test_without_trigrams_only_the_bigram_rows_contribute():
    """NgramConfig.trigram False: every trigram takes the reserved row and the gather is the
    signed bigram row alone, so no trigram row gets a gradient."""
    torch.manual_seed(0)
    with_tri, without = _store(_cfg()), _store(_cfg(trigram=False))
    table = torch.randn_like(with_tri.table)
    x = _tokens(24)
    outs = {}
    for name, store in (("with", with_tri), ("without", without)):
        store.table.copy_(table)
        slots = store.slots_for(x)
        sink = store.lookup.grad_sink(24)
        outs[name] = store.lookup.gather(slots, sink)
        outs[name].sum().backward()
        outs[name + "_grad"] = sink.grad
    ids = without.lookup.row_ids(x)
    assert (ids[24:] == 97 + 88).all()
    bigram_only = (table[ids[:24]] * without.lookup.sign[without.lookup.sign_ids(x)[:24]])
    assert torch.allclose(outs["without"], bigram_only)
    assert not torch.allclose(outs["with"], bigram_only)  # the trigrams did contribute there
    assert not outs["without_grad"][24:].any() and outs["with_grad"][24:].any()


def test_without_trigrams_the_trigram_rows_are_dead_so_a_small_half_trains_the_same():
    """NgramConfig.trigram False, dense decayed Adam (the record profile's n-gram table): the
    trigram rows are never read and stay zero through every event, so a table with 8 trigram
    rows (MODEL_PROFILES["record"]) trains its bigram rows bitwise as one with the full half,
    which the dense event would sweep for nothing."""
    stores = [_store(_cfg(trigram=False, update="dense", weight_decay=0.025, trigram_rows=g))
              for g in (89, 8)]
    torch.manual_seed(0)
    init = torch.randn(97, 8, dtype=torch.float64)
    for store in stores:
        store.table[:97].copy_(init)
    for step in range(6):
        x = _tokens(16, seed=step)
        upstream = torch.randn(16, 8, dtype=torch.float64)
        for store in stores:
            ids = store.lookup.row_ids(x)
            sink = store.lookup.grad_sink(16)
            (store.lookup.gather(store.slots_for(x, ids), sink) * upstream).sum().backward()
            store.hold(sink.grad, ids)  # [2T, R]: its trigram half is zero (trigram off)
            sink.grad = None  # the next micro-step's gradient alone, as the trainer's replay writes it
            if step % 2 == 1:
                store.update_event(step)
    full, small = stores
    assert full.num_updates == small.num_updates == 3
    # the hold adds the bigram half alone: no trigram row (the reserved one) is ever touched
    x = _tokens(16, seed=9)
    ids = small.lookup.row_ids(x)
    sink = small.lookup.grad_sink(16)
    (small.lookup.gather(small.slots_for(x, ids), sink) * torch.randn(16, 8, dtype=torch.float64)).sum().backward()
    small.hold(sink.grad, ids)
    assert not small.touched[97:].any() and small.touched[ids[:16]].all()
    expected = torch.zeros_like(small.grad_acc).index_add_(0, ids, sink.grad)  # both halves
    assert torch.equal(small.grad_acc, expected)  # the same sums: the trigram half was zero
    sink.grad = None
    for name in ("table", "exp_avg", "exp_avg_sq"):
        a, b = getattr(full, name), getattr(small, name)
        assert torch.equal(a[:97], b[:97]), name
        assert not a[97:].any() and not b[97:].any(), name  # the trigram rows never move
    assert not torch.equal(full.table[:97], init)  # the bigram rows did train


def test_gather_and_sink_grad_equal_dense_embedding():
    torch.manual_seed(0)
    table = _store(_cfg())
    lookup = table.lookup
    table.table.copy_(torch.randn_like(table.table))
    x = _tokens(24)
    ids = lookup.row_ids(x)
    slots = table.slots_for(x, ids)
    sink = lookup.grad_sink(24)
    out = lookup.gather(slots, sink)  # [T, R]
    dense = torch.nn.Embedding(table.cfg.num_rows, 8, dtype=torch.float64)
    dense.weight.data.copy_(table.table)
    sign = lookup.sign[lookup.sign_ids(x)]
    ref = (dense(ids) * sign).view(2, 24, 8).sum(0)
    assert torch.allclose(out, ref)
    upstream = torch.randn(24, 8, dtype=torch.float64)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    per_row = torch.zeros_like(dense.weight).index_add_(0, ids, sink.grad)
    assert torch.allclose(per_row, dense.weight.grad)


def test_update_events_match_sparse_adam_and_addresses_stay():
    torch.manual_seed(0)
    cfg, schedule = _cfg(), Schedule(ScheduleConfig(ngram_cycle=2))
    table = _store(cfg, cycle=schedule.cfg.ngram_cycle)
    lookup = table.lookup
    init = torch.randn_like(table.table)
    table.table.copy_(init)
    ref = torch.nn.Embedding(cfg.num_rows, 8, sparse=True, dtype=torch.float64)
    ref.weight.data.copy_(init)
    opt = torch.optim.SparseAdam(ref.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    ptrs = [lookup.cache.data_ptr()]
    touched = torch.zeros(cfg.num_rows, dtype=torch.bool)
    for step in range(6):
        x = _tokens(16, seed=step)
        ids = lookup.row_ids(x)
        table.slots_for(x, ids)
        sink = lookup.grad_sink(16)
        ptrs.append(sink.data_ptr())
        grad = torch.randn(32, 8, dtype=torch.float64)
        table.hold(grad, ids)
        (ref(ids) * grad).sum().backward()  # dense reference accumulates the same rows
        grad.fill_(float("nan"))  # as a graph's next replay rewrites its buffer: hold read it
        touched[ids] = True
        if schedule.plan(step).ngram_event:
            before = table.table.clone()
            table.update_event(step)
            opt.step()
            opt.zero_grad()
            assert torch.allclose(table.table, ref.weight.data, atol=1e-12)
            assert torch.equal(table.table[~touched], before[~touched])
            table.slots_for(x, ids)  # the next pull refills the cache from the updated table
            assert torch.equal(lookup.cache[:32], table.table[ids])
            touched[:] = False
        assert lookup.cache.data_ptr() == ptrs[0] and lookup.grad_sink(16).data_ptr() == ptrs[1]
    assert table.num_updates == 3
    table.reset()
    lookup.reset()
    assert lookup.cache.data_ptr() == ptrs[0] and lookup.grad_sink(16).data_ptr() == ptrs[1]
    assert table.table.abs().sum() == 0 and table.exp_avg.abs().sum() == 0 and table.num_pending == 0
    assert not table.grad_acc.any() and not table.touched.any()


@pytest.mark.parametrize("trigram", [True, False])
def test_rows_in_the_step_equal_the_pull_and_hold_around_it(trigram):
    """pull_ writes the ids, the cache rows and the slots slots_for returns; accumulate_ plus a
    counted hold(None, None) leaves the accumulator, the touched rows and the count of
    hold(grad, ids) (the bigram half alone without trigrams), through an update event."""
    cfg = _cfg(trigram=trigram)
    inside, around = _store(cfg), _store(cfg)
    init = torch.randn_like(inside.table)
    inside.table.copy_(init)
    around.table.copy_(init)
    assert inside.rows_in_step
    for step in range(4):
        x = _tokens(16, seed=step)
        ids_in = torch.full((32,), -1, dtype=torch.int64)
        slots_in = torch.full((32,), -1, dtype=torch.int64)
        inside.pull_(x, ids_in, slots_in)
        ids = around.lookup.row_ids(x)
        slots = around.slots_for(x, ids)
        assert torch.equal(ids_in, ids) and torch.equal(slots_in, slots)
        assert torch.equal(inside.lookup.cache[:32], around.lookup.cache[:32])
        grad = torch.randn(32, 8, dtype=torch.float64)
        inside.accumulate_(grad, ids_in)
        inside.hold(None, None)
        around.hold(grad, ids)
        assert inside.num_pending == around.num_pending == step % 2 + 1
        assert torch.equal(inside.grad_acc, around.grad_acc)
        assert torch.equal(inside.touched, around.touched)
        if step % 2:
            inside.update_event(step)
            around.update_event(step)
            assert torch.equal(inside.table, around.table)
    roles = dict(inside.baked_tensors())
    assert set(roles) == {"ngram_store.table", "ngram_store.grad_acc", "ngram_store.touched"}
    assert roles["ngram_store.grad_acc"] is inside.grad_acc
    with pytest.raises(ValueError, match="both the sink gradient and its row ids"):
        inside.hold(torch.zeros(32, 8, dtype=torch.float64), None)


def test_rows_in_the_step_need_one_rank():
    table = _store(_cfg(bigram_rows=96, trigram_rows=96))
    table.shard(0, 2)
    assert not table.rows_in_step
    with pytest.raises(RuntimeError, match="one rank"):
        table.pull_(_tokens(8), torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64))


def test_hold_beyond_cycle_is_caught():
    table = _store(_cfg(), cycle=1)
    assert table.max_held == 1
    x = _tokens(8)
    table.hold(torch.zeros(16, 8, dtype=torch.float64), table.lookup.row_ids(x))
    with pytest.raises(RuntimeError, match="update event was missed"):
        table.hold(torch.zeros(16, 8, dtype=torch.float64), table.lookup.row_ids(x))


def test_bad_inputs_raise():
    table = _store(_cfg())
    with pytest.raises(ValueError, match="60000"):
        table.lookup.row_ids(torch.tensor([1, 60000], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_rows=64"):
        table.slots_for(_tokens(40))
    with pytest.raises(ValueError, match="ngram_cycle"):
        NgramStore(table.lookup, cycle=0, micro_steps=1)
    with pytest.raises(ValueError, match="micro_steps"):
        NgramStore(table.lookup, cycle=2, micro_steps=0)


def test_state_dict_roundtrip():
    a = _store(_cfg())
    a.table.normal_()
    b = _store(_cfg(seed=1))
    b.load_state_dict(a.state_dict())
    b.lookup.load_state_dict(a.lookup.state_dict())
    assert torch.equal(a.table, b.table) and torch.equal(a.lookup.sign, b.lookup.sign)
    assert "cache" not in a.lookup.state_dict() and a.lookup.sign.shape == (SIGN_ROWS, 8)
    # the store saves the table and its Adam state, the model (the lookup) the signs
    assert set(a.state_dict()) == {"table", "exp_avg", "exp_avg_sq", "num_updates"}
    assert set(a.lookup.state_dict()) == {"sign"}


def test_the_accumulate_setting_resolves_by_device():
    """train.ngram_accumulate: "auto" is the vector-atomic kernel for a float32 accumulator on
    CUDA and index_add_ otherwise; a kernel named where it cannot run is a clear error; an
    unknown name too."""
    from track_1_short.perf.ngram_store import resolve_accumulate

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_accumulate("auto", cuda) == "vector_atomic"
    assert resolve_accumulate("auto", cpu) == "index_add"
    assert resolve_accumulate("sorted", cuda) == "sorted"
    assert resolve_accumulate("index_add", cuda) == "index_add"
    assert resolve_accumulate("auto", cuda, torch.float64) == "index_add"  # the kernels take float32
    for name in ("vector_atomic", "sorted"):
        with pytest.raises(ValueError, match=f"accumulate='{name}' is a CUDA kernel"):
            resolve_accumulate(name, cpu)
        with pytest.raises(ValueError, match="this one is torch.float64 on cuda"):
            resolve_accumulate(name, cuda, torch.float64)
    with pytest.raises(ValueError, match="one of"):
        resolve_accumulate("atomic", cpu)
    store = _store(_cfg())  # the default: auto
    assert store.accumulate == "index_add" and store.accumulate_kernel is None


def test_the_run_says_what_sums_the_held_gradients():
    """The run's n-gram line (trainer/build.describe_ngram_rows) names the resolved accumulate."""
    from types import SimpleNamespace

    from track_1_short.trainer.build import describe_ngram_rows

    store = _store(_cfg())
    for in_step in (True, False):
        line = describe_ngram_rows(SimpleNamespace(ngram=store, prefetch=SimpleNamespace(rows_in_step=in_step)))
        assert line.endswith("held gradients summed by index_add (train.ngram_accumulate)"), line
