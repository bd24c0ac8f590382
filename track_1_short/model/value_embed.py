"""ValueEmbedPull: the value-embedding tables, with a backward that index_adds into one persistent
gradient buffer instead of producing a dense .grad.

What it replaces: HEAD modded-nanogpt's `value_embeds` (one dense 5 x 50304 x 768 parameter, 193M
values, facts 1.1/1.2), whose backward materialises a dense 193M-value gradient every micro-step and
whose Adam reads it. Here the forward gathers rows by token id, the backward adds only the T touched
rows per table into `grad_accum`, and the optimizer consumes that buffer every 2nd step (Adam
cadence, facts 3) and zeroes it in place. Under CUDA graphs the buffer is a fixed address that the
captured backward writes into, so no gradient allocation or AccumulateGrad happens at replay.

What must stay address-stable: `weight` (Parameter [NT*V, D], table k's rows at k*V, as HEAD's
251,520 x 768 layout) and `grad_accum` (same shape, weight's dtype unless given); both are never
reallocated. The step graphs pass `value_embed_grad=self.value_embeds.grad_accum` into the
forward; `torch.autograd.grad` returns None for `weight` (the gradient went to grad_accum).

Call order: GPT.forward calls `lookup(table_index, ids, grad_accum)` for each value-embedding layer;
the optimizer reads grad_accum as the weight's gradient (AnvilAndAdam.set_grad_buffer) on Adam
steps, updates `weight`, then zeroes grad_accum in place. With grad_accum=None, lookup is a plain
differentiable gather (dense .grad; eval and reference tests). Single-device tensor ops only: this
module is model/ (the trainer's perf/value_embed_pull.py re-exports it under the seed's name).
`pull_rows` is the gather itself, shared with the token embedding (GPT's `embed_grad_accum`, the
same pattern for the one [V, D] table: no dense [V, D] gradient per micro-step and no
accumulator add, TrainConfig.embed_grad).

Provenance: our design (DESIGN.md section 4, "ValueEmbedPull"); HEAD value embedding init
0.01 * randn (facts 1.1). Legend: NT tables, V vocab, D model dim, T tokens.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _PullRows(torch.autograd.Function):
    """rows = weight[ids]; backward: grad_accum.index_add_(ids, grad); no gradient for weight."""

    @staticmethod
    def forward(ctx, weight: Tensor, ids: Tensor, grad_accum: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.grad_accum = grad_accum
        return weight[ids]  # [T, D]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        ctx.grad_accum.index_add_(0, ids, grad.to(ctx.grad_accum.dtype))
        return None, None, None


def pull_rows(weight: Tensor, ids: Tensor, grad_accum: Tensor | None) -> Tensor:
    """weight[ids] [T, D] for int64 ids [T]. With `grad_accum` (a persistent buffer of weight's
    shape) the backward adds the T rows' gradient into it (index_add_, in its dtype) and gives
    weight no gradient; with None it is a plain differentiable gather (dense weight.grad, the
    reference the pulled path is tested against). The one definition of the pulled gather: the
    value-embedding tables here and the token embedding (GPT.forward's embed_grad) use it."""
    if grad_accum is None:
        # F.embedding, not weight[ids]: its backward sums in float32 (indexing's backward adds
        # in weight's dtype with atomics: a bf16 table's gradient then differed by 1.4% between
        # a captured backward and an eager one on the H200, failing the step graphs' self-check)
        return F.embedding(ids, weight)
    return _PullRows.apply(weight, ids, grad_accum)


class ValueEmbedPull(nn.Module):
    """Concern: the value-embedding tables and their row gather, whose backward adds into a
    persistent gradient buffer (grad_accum) instead of a dense table gradient."""

    def __init__(self, num_tables: int, vocab_size: int, dim: int, init_std: float = 0.01,
                 grad_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_tables, self.vocab_size, self.dim = num_tables, vocab_size, dim
        rows = num_tables * vocab_size
        self.weight = nn.Parameter(torch.randn(rows, dim) * init_std)  # [NT*V, D]
        dtype = grad_dtype or self.weight.dtype
        self.register_buffer("grad_accum", torch.zeros(rows, dim, dtype=dtype),
                             persistent=False)  # [NT*V, D]

    def lookup(self, table: int, ids: Tensor, grad_accum: Tensor | None = None) -> Tensor:
        """Rows of table `table` (a Python int) for token ids [T] -> [T, D]."""
        return pull_rows(self.weight, ids.long() + table * self.vocab_size, grad_accum)

    @torch.no_grad()
    def zero_grad_accum_(self):
        self.grad_accum.zero_()
