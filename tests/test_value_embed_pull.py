"""ValueEmbedPull: grad_accum equals a dense embedding's gradient (float64), accumulates over two
steps, is zeroed in place, keeps its address, and works the same under torch.compile (aot_eager,
fullgraph) where the backward's index_add_ into the persistent buffer is a side effect.

Hardware: CPU only, < 15 s. Run: `.venv/bin/python -m pytest tests/test_value_embed_pull.py -q`.
"""

import torch

from track_1_short.model.value_embed import ValueEmbedPull


def _setup():
    torch.manual_seed(0)
    pull = ValueEmbedPull(num_tables=3, vocab_size=50, dim=4).double()
    dense = torch.nn.Embedding(150, 4, dtype=torch.float64)
    dense.weight.data.copy_(pull.weight.data)
    return pull, dense


def _loss(rows_by_table, upstream):
    return sum((rows * u).sum() for rows, u in zip(rows_by_table, upstream))


def _step(pull, dense, ids, upstream, fn=None):
    lookups = fn or (lambda: [pull.lookup(k, ids, pull.grad_accum) for k in range(3)])
    _loss(lookups(), upstream).backward()
    _loss([dense(ids.long() + 50 * k) for k in range(3)], upstream).backward()


def test_grad_accum_equals_dense_gradient_over_two_steps():
    pull, dense = _setup()
    ptr = pull.grad_accum.data_ptr()
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 50, (20,), generator=g, dtype=torch.int32)  # repeats included
        upstream = [torch.randn(20, 4, generator=g, dtype=torch.float64) for _ in range(3)]
        _step(pull, dense, ids, upstream)
    assert pull.weight.grad is None
    assert torch.allclose(pull.grad_accum, dense.weight.grad)
    pull.zero_grad_accum_()
    assert pull.grad_accum.abs().sum() == 0 and pull.grad_accum.data_ptr() == ptr


def test_lookup_without_accum_is_dense():
    pull, dense = _setup()
    ids = torch.tensor([3, 3, 7])
    rows = pull.lookup(2, ids)
    assert torch.equal(rows, dense(ids + 100))
    rows.sum().backward()
    assert pull.weight.grad[103].sum() == 8 and pull.grad_accum.abs().sum() == 0


def test_compiled_pull_matches_dense():
    pull, dense = _setup()
    ptr = pull.grad_accum.data_ptr()

    def fn(ids, accum):
        return [pull.lookup(k, ids, accum) for k in range(3)]

    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 50, (16,), generator=g)
        upstream = [torch.randn(16, 4, generator=g, dtype=torch.float64) for _ in range(3)]
        _step(pull, dense, ids, upstream, fn=lambda: compiled(ids, pull.grad_accum))
    assert torch.allclose(pull.grad_accum, dense.weight.grad)
    assert pull.grad_accum.data_ptr() == ptr and pull.weight.grad is None
