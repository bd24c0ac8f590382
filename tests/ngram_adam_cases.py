"""Kernel cases of track_1_short/kernels/ngram_adam.py in the Triton interpreter (CPU).

Scope: NgramStore's update event through the kernel against its reference (`_event_reference`:
nonzero, gathers, torch.optim.SparseAdam's formula, scatters) from the same state, float32, over
several events with duplicate row ids inside and across micro-steps, rows never touched, a row
count that is not a multiple of the kernel's rows per program, a row width that is not a power of
two, and lr multipliers that change between events; after every event table, exp_avg, exp_avg_sq
agree within float32 rounding, untouched rows are bit-equal, and the accumulator and touched
flags are zero. Also the kernel's own input errors.

Not collected by the normal suite (the name does not match test_*.py): TRITON_INTERPRET=1 must be
set before triton is first imported, so tests/test_ngram_adam.py runs this file in its own process.
Hardware: CPU, a few seconds.
Run: `TRITON_INTERPRET=1 PYTHONPATH=. .venv/bin/python -m pytest -q tests/ngram_adam_cases.py`.

Legend: T tokens, R row width, N table rows.
"""

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("tests/ngram_adam_cases.py needs TRITON_INTERPRET=1 set before triton is "
                       "imported; run it through tests/test_ngram_adam.py or as its docstring says")

import pytest  # noqa: E402
import torch  # noqa: E402

from track_1_short.kernels.ngram_adam import interpreted, sparse_adam_rows  # noqa: E402
from track_1_short.model.ngram_config import NgramConfig  # noqa: E402
from track_1_short.model.ngram_lookup import NgramLookup  # noqa: E402
from track_1_short.perf.ngram_store import NgramStore  # noqa: E402

T, R = 24, 12  # tokens per micro-batch, row width (not a power of two)
VOCAB = 64


def _store(kernel: bool, micro_steps: int, update: str = "lazy", weight_decay: float = 0.0) -> NgramStore:
    cfg = NgramConfig(dim=R, vocab_size=VOCAB, bigram_rows=61, trigram_rows=50, cache_rows=2 * T,
                      bos_id=VOCAB - 1, update=update,
                      weight_decay=weight_decay)  # N = 111 rows: not a multiple of 4
    store = NgramStore(NgramLookup(cfg), cycle=2, micro_steps=micro_steps)
    store.event_kernel = sparse_adam_rows if kernel else None
    return store


def test_runs_interpreted():
    assert interpreted()


@pytest.mark.parametrize("micro_steps,update,wd", [(1, "lazy", 0.0), (3, "lazy", 0.0), (1, "dense", 0.0),
                                                   (3, "dense", 0.0), (1, "lazy", 0.5), (3, "dense", 0.5)])
def test_event_kernel_equals_the_reference(micro_steps, update, wd):
    """Lazy: a row moves only in the events it was touched for; dense: a row touched earlier keeps
    moving (its momentum); never-touched rows stay bit-equal in both (with the cautious weight
    decay too: their update is 0, so the decay's mask is off)."""
    g = torch.Generator().manual_seed(micro_steps)
    kernel, reference = (_store(k, micro_steps, update, wd) for k in (True, False))
    init = torch.randn(kernel.table.shape, generator=g)
    for s in (kernel, reference):
        s.table.copy_(init)
    untouched_ever = torch.ones(kernel.cfg.num_rows, dtype=torch.bool)
    for event, lr_scale in enumerate((1.0, 0.7, 0.3)):
        touched_now = torch.zeros(kernel.cfg.num_rows, dtype=torch.bool)
        for _ in range(2 * micro_steps):  # one cycle: 2 steps of micro_steps
            # few distinct tokens: row ids repeat inside the micro-batch and across micro-steps;
            # event 1 draws other tokens, so some rows were touched only in event 0
            lo = 4 * (event == 1)
            inputs = torch.randint(lo, lo + 4, (T,), generator=g, dtype=torch.int32)
            ids = kernel.lookup.row_ids(inputs)
            grad = torch.randn(2 * T, R, generator=g)
            for s in (kernel, reference):
                s.hold(grad, ids)
            untouched_ever[ids] = False
            touched_now[ids] = True
        assert kernel.touched.sum() == reference.touched.sum() > 0
        before = kernel.table.clone()
        for s in (kernel, reference):
            s.update_event(event, lr_scale)
        for name in ("table", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(getattr(kernel, name), getattr(reference, name),
                                       rtol=2e-6, atol=2e-6, msg=f"event {event}: {name}")
        assert torch.equal(kernel.table[untouched_ever], before[untouched_ever])
        earlier = ~untouched_ever & ~touched_now  # touched in an earlier event, not in this one
        if event > 0:
            assert earlier.any(), "the case must have rows touched only earlier"
            moved = (kernel.table[earlier] != before[earlier]).any(1)
            assert moved.all() if update == "dense" else not moved.any(), update
        assert untouched_ever.any(), "the case must leave some rows untouched"
        assert not kernel.grad_acc.any() and not kernel.touched.any()
        assert int(kernel.num_updates) == event + 1


def test_lazy_event_lists_every_touched_row_once_across_programs():
    """The listing pass over several programs (111 rows, 16 flags each) reserves disjoint slots:
    the listed rows are exactly the touched ones; the persistent pass (3 programs, 4-row tiles,
    so each program loops) moves exactly those rows and clears their flags and accumulator."""
    store = _store(True, 1)
    g = torch.Generator().manual_seed(7)
    touched = torch.rand(store.cfg.num_rows, generator=g) < 0.6  # ~67 rows: 17 tiles
    store.touched.copy_(touched.int())
    store.grad_acc[touched] = torch.randn(int(touched.sum()), R, generator=g)
    store.num_updates.fill_(1)
    before = store.table.clone()
    sparse_adam_rows(store.table, store.exp_avg, store.exp_avg_sq, store.grad_acc, store.touched,
                     store.num_updates, store.event_rows, store.event_count, lr=0.1, beta1=0.9,
                     beta2=0.99, eps=1e-8)
    count = int(store.event_count)
    assert count == int(touched.sum()) > 3 * 4 * 2  # more tiles than two rounds of 3 programs
    listed = store.event_rows[:count].long()
    assert torch.equal(listed.sort().values, touched.nonzero().squeeze(1))
    moved = (store.table != before).any(1)
    assert torch.equal(moved, touched)
    assert not store.touched.any() and not store.grad_acc.any()


def test_kernel_input_errors_name_the_argument():
    store = _store(True, 1)
    args = [store.table, store.exp_avg, store.exp_avg_sq, store.grad_acc, store.touched,
            store.num_updates, store.event_rows, store.event_count]
    kw = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8)
    with pytest.raises(ValueError, match="touched must be a contiguous int32"):
        sparse_adam_rows(*args[:4], store.touched.long(), *args[5:], **kw)
    with pytest.raises(ValueError, match="acc .* shaped like the table"):
        sparse_adam_rows(*args[:3], store.grad_acc[:-1], *args[4:], **kw)
    with pytest.raises(ValueError, match="must be float32"):
        sparse_adam_rows(args[0], store.exp_avg.double(), *args[2:], **kw)
    with pytest.raises(ValueError, match="row_list must be a contiguous int32"):
        sparse_adam_rows(*args[:6], store.event_rows[:-1], args[7], **kw)
    with pytest.raises(ValueError, match="row_count must be a contiguous int32 \\[1\\]"):
        sparse_adam_rows(*args[:7], store.event_count.long(), **kw)
