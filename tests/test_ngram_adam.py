"""The n-gram event kernel (track_1_short/kernels/ngram_adam.py) on the CPU.

Scope: the kernel cases (tests/ngram_adam_cases.py: the store's event through the kernel against
its reference, the kernel's input errors) run in a child pytest process with TRITON_INTERPRET=1,
which must be set before triton is imported and must not leak into this process. Here, without
the interpreter: a CPU call is a clear error, and a CPU store runs the reference.
Hardware: CPU (needs triton installed; skipped otherwise); ~20 s.
Run: `PYTHONPATH=. .venv/bin/python -m pytest tests/test_ngram_adam.py -q`.
"""


import pytest
import torch

pytest.importorskip("triton")

from tests.interpreter_cases import run_interpreter_cases  # noqa: E402
from track_1_short.kernels import ngram_adam  # noqa: E402
from track_1_short.model.ngram_config import NgramConfig  # noqa: E402
from track_1_short.model.ngram_lookup import NgramLookup  # noqa: E402
from track_1_short.perf.ngram_store import NgramStore  # noqa: E402

NUM_CASES = 9  # tests in ngram_adam_cases.py (parametrizations included)


def test_kernel_cases_in_the_triton_interpreter():
    run_interpreter_cases("ngram_adam_cases.py", NUM_CASES)


def test_cpu_store_runs_the_reference_and_a_cpu_kernel_call_is_an_error():
    store = NgramStore(NgramLookup(NgramConfig(dim=8, bigram_rows=16, trigram_rows=16,
                                               cache_rows=32)), cycle=1, micro_steps=1)
    assert store.event_kernel is None  # CUDA stores get the kernel
    if ngram_adam.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match="runs on CUDA"):
        ngram_adam.sparse_adam_rows(store.table, store.exp_avg, store.exp_avg_sq, store.grad_acc,
                                    store.touched, store.num_updates, store.event_rows,
                                    store.event_count, lr=0.1, beta1=0.9,
                                    beta2=0.99, eps=1e-8)
    ids = store.lookup.row_ids(torch.arange(8, dtype=torch.int32))
    store.hold(torch.ones(16, 8), ids)
    store.update_event(0)
    assert store.table[ids].ne(0).all() and not store.touched.any()


def test_cautious_weight_decay_of_the_reference():
    """NgramConfig.weight_decay (the optimizer's Adam rule): at the first event the update of a
    row is lr * sign(g) (bias-corrected Adam of one gradient), so a row whose value has the
    update's sign shrinks by lr^2 * wd of itself on top of the update, one of the other sign
    gets the update alone; with weight_decay 0 neither shrinks."""
    lr, wd = 0.5, 0.4
    results = {}
    for decay in (0.0, wd):
        store = NgramStore(NgramLookup(NgramConfig(dim=4, bigram_rows=16, trigram_rows=16,
                                                   cache_rows=32, lr=lr, weight_decay=decay)),
                           cycle=1, micro_steps=1)
        store.table.fill_(2.0)
        ids = store.lookup.row_ids(torch.arange(1, dtype=torch.int32))  # [2]: a bigram, a trigram row
        grad = torch.tensor([[1.0] * 4, [-1.0] * 4])  # row 0 moves down (update +), row 1 up
        store.hold(grad, ids)
        store.update_event(0)
        results[decay] = store.table[ids].clone()
    plain, decayed = results[0.0], results[wd]
    torch.testing.assert_close(plain, torch.tensor([[2.0 - lr] * 4, [2.0 + lr] * 4]))
    torch.testing.assert_close(decayed[0], plain[0] - lr * lr * wd * 2.0)  # same sign: decays
    torch.testing.assert_close(decayed[1], plain[1])  # update against the row: no decay
