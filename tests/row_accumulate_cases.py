"""Kernel cases of track_1_short/kernels/row_accumulate.py in the Triton interpreter (CPU).

Scope: both kernels (row_accumulate_, the sorted one, and row_accumulate_vector_, the
vector-atomic one) against their reference acc.index_add_(0, ids, grad) from the same
accumulator: ids with long runs of one row (the reserved rows' case), ids all distinct, one id,
rows never hit left bit-equal, a row width that is not a multiple of the kernel's column block
and one wider than a block, a gradient with a row stride (the bigram half of a [2T, R] sink
gradient), real n-gram row ids of a token batch, and a second call adding onto the first; the
sums agree within float32 rounding. Also the kernel's input errors.

Not collected by the normal suite (the name does not match test_*.py): TRITON_INTERPRET=1 must be
set before triton is first imported, so tests/test_row_accumulate.py runs this file in its own
process. Hardware: CPU, a few seconds.
Run: `TRITON_INTERPRET=1 PYTHONPATH=. .venv/bin/python -m pytest -q tests/row_accumulate_cases.py`.

Legend: N ids, R row width, ROWS accumulator rows.
"""

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("tests/row_accumulate_cases.py needs TRITON_INTERPRET=1 set before triton is "
                       "imported; run it through tests/test_row_accumulate.py or as its docstring says")

import pytest  # noqa: E402
import torch  # noqa: E402

from track_1_short.kernels.row_accumulate import (  # noqa: E402
    BLOCK_R, interpreted, row_accumulate_, row_accumulate_vector_)
from track_1_short.model.ngram_config import NgramConfig  # noqa: E402
from track_1_short.model.ngram_lookup import NgramLookup  # noqa: E402


KERNELS = [row_accumulate_, row_accumulate_vector_]


def _check_against_reference(ids: torch.Tensor, grad: torch.Tensor, rows: int, calls: int = 1):
    """Each kernel from the same accumulator as index_add_, `calls` times."""
    g = torch.Generator().manual_seed(1)
    start = torch.randn(rows, grad.shape[1], generator=g)
    ref = start.clone()
    for _ in range(calls):
        ref.index_add_(0, ids, grad)
    for kernel in KERNELS:
        out = start.clone()
        for _ in range(calls):
            kernel(out, ids, grad)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (kernel.__name__, (out - ref).abs().max())
        hit = torch.zeros(rows, dtype=torch.bool)
        hit[ids] = True
        assert torch.equal(out[~hit], start[~hit])  # rows no id names are untouched, bit for bit


def test_interpreted():
    assert interpreted()


@pytest.mark.parametrize("width", [7, 12, BLOCK_R + 3, 2 * BLOCK_R + 4])
def test_runs_of_one_row_and_distinct_rows(width):
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.full((40,), 5), torch.randperm(30, generator=g)[:20] + 10,
                     torch.full((9,), 2), torch.tensor([5, 5, 39])])  # runs, distinct rows, a late 5
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    grad = torch.randn(ids.numel(), width, generator=g)
    _check_against_reference(ids, grad, rows=48, calls=2)


def test_one_id_and_every_id_the_same():
    grad = torch.randn(1, 5)
    _check_against_reference(torch.tensor([3]), grad, rows=4)
    _check_against_reference(torch.zeros(17, dtype=torch.int64), torch.randn(17, 5), rows=4)


def test_real_row_ids_and_a_strided_half():
    """The store's case: n-gram row ids of a token batch (bigram and trigram halves), and the
    bigram half alone of a [2T, R] gradient (a strided view, NgramLookup.read_rows)."""
    cfg = NgramConfig(dim=12, vocab_size=64, bigram_rows=29, trigram_rows=23, cache_rows=64, bos_id=63)
    lookup = NgramLookup(cfg)
    inputs = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(2), dtype=torch.int64)
    inputs[[0, 11, 20]] = 63  # document starts: the reserved rows repeat
    ids = lookup.row_ids(inputs.to(torch.int32))  # [2T]
    grad = torch.randn(ids.numel(), cfg.dim)
    _check_against_reference(ids, grad, rows=cfg.num_rows)
    half = ids.numel() // 2
    _check_against_reference(ids[:half], grad[:half], rows=cfg.num_rows)
    wide = torch.randn(half, 2 * cfg.dim)[:, : cfg.dim]  # row stride 2R
    _check_against_reference(ids[:half], wide, rows=cfg.num_rows)


def test_a_gradient_with_a_column_stride():
    """A transposed gradient (column stride N): the vector kernel copies it, the sums hold."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 9, (21,), generator=g)
    _check_against_reference(ids, torch.randn(8, 21, generator=g).t(), rows=9, calls=2)


@pytest.mark.parametrize("change,match", [
    (dict(acc=torch.zeros(4, 3, dtype=torch.float64)), "acc must be a contiguous float32"),
    (dict(grad=torch.zeros(2, 4)), r"grad must be float32 \[N, 3\]"),
    (dict(ids=torch.zeros(3, dtype=torch.int64)), r"ids must be int64 \[2\]"),
    (dict(ids=torch.zeros(2, dtype=torch.int32)), r"ids must be int64"),
])
@pytest.mark.parametrize("kernel", KERNELS)
def test_input_errors(change, match, kernel):
    args = dict(acc=torch.zeros(4, 3), ids=torch.zeros(2, dtype=torch.int64), grad=torch.zeros(2, 3))
    args.update(change)
    with pytest.raises(ValueError, match=f"{kernel.__name__}: {match}"):
        kernel(args["acc"], args["ids"], args["grad"])


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_store_hold_through_the_kernel(kernel):
    """NgramStore.hold with the kernel as its accumulate_kernel (what accumulate="sorted" or
    "vector_atomic" installs on CUDA) against the store's index_add_ path, over three micro-steps with and without
    trigrams: the accumulators agree within float32 rounding, the touched flags are equal."""
    from track_1_short.perf.ngram_store import NgramStore

    for trigram in (True, False):
        cfg = NgramConfig(dim=10, vocab_size=64, bigram_rows=29, trigram_rows=23, cache_rows=64,
                          bos_id=63, trigram=trigram)
        ref, fast = (NgramStore(NgramLookup(cfg), cycle=1, micro_steps=3) for _ in range(2))
        fast.accumulate_kernel = kernel
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            inputs = torch.randint(0, 64, (32,), generator=g).to(torch.int32)
            ids, grad = ref.lookup.row_ids(inputs), torch.randn(64, cfg.dim, generator=g)
            ref.hold(grad, ids)
            fast.hold(grad, ids)
        assert torch.allclose(fast.grad_acc, ref.grad_acc, rtol=1e-5, atol=1e-5)
        assert torch.equal(fast.touched, ref.touched) and fast.grad_acc.abs().sum() > 0
