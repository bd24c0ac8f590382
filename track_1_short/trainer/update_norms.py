"""--update-norms START:END: how far each parameter moved in each timed step of a window, to see
which part of the model an optimizer step pushes (e.g. the first Adam steps after a stage
transition, docs/LOG.md tenth session).

What it measures, per probed step s (steps START <= s < END the run trains): for every named
parameter of the model and for this rank's n-gram table shard (`ngram_table`), the RMS of the
change that step s made (optimizer step, embed/head untie, n-gram update event: everything
train_step changes) and the RMS of the value after it:
    update_rms = sqrt(mean((p_after - p_before)^2)),  param_rms = sqrt(mean(p_after^2))
in float32 over the stored tensor (bf16 banks as the forward reads them, not the optimizer's
float32 masters). One metrics line per probed step on rank 0: {kind: "update_norms", step,
stage, norms: {name: [update_rms, param_rms]}}.

Cost: a copy of every parameter and the table shard before the step (at the speedrun's size on
one GPU ~0.7 GB of parameters plus the float32 table, 2.3 GB with trigram rows, 1.2 GB without;
the differences take as much again while they are reduced) and one host sync after it, outside
the step's timer and the run's clock; steps outside the window pay nothing. A diagnostic for loss
runs, not for timing runs.

Call order (trainer/phases.timed_run), for the steps where probes(step): before() -> train_step ->
after() -> metrics.
"""

from __future__ import annotations

import torch
from torch import Tensor

NGRAM_TABLE = "ngram_table"  # the name of the n-gram table shard in the norms


class UpdateNorms:
    """Concern: the per-parameter update and value RMS of the steps in one window."""

    def __init__(self, tensors: dict[str, Tensor], window: tuple[int, int]):
        """tensors: name -> the tensor the step updates in place (the model's parameters, the
        n-gram table shard); window: [start, end) of the steps to probe."""
        self.tensors, (self.start, self.end) = tensors, window
        self._before: dict[str, Tensor] | None = None

    def probes(self, step: int) -> bool:
        """Whether `step` is in the window (the caller runs before / after around it)."""
        return self.start <= step < self.end

    @torch.no_grad()
    def before(self) -> None:
        """Copy every tensor before a probed step trains."""
        self._before = {name: t.detach().clone() for name, t in self.tensors.items()}

    @torch.no_grad()
    def after(self) -> dict[str, list[float]]:
        """{name: [update_rms, param_rms]} of the step since before(). One host sync (the
        stacked values)."""
        if self._before is None:
            raise RuntimeError("UpdateNorms.after() without before()")
        rows = []
        for name, t in self.tensors.items():
            now = t.detach().float()
            rows.append(torch.stack([(now - self._before[name].float()).square().mean().sqrt(),
                                     now.square().mean().sqrt()]))
        values = torch.stack(rows).tolist()  # the one sync
        self._before = None
        return dict(zip(self.tensors, values))


def model_tensors(model: torch.nn.Module, ngram_table: Tensor) -> dict[str, Tensor]:
    """The tensors a step changes: every named parameter and the n-gram table shard."""
    out = {name: p for name, p in model.named_parameters()}
    if NGRAM_TABLE in out:
        raise ValueError(f"a model parameter is named {NGRAM_TABLE!r}, the n-gram table's name here")
    out[NGRAM_TABLE] = ngram_table
    return out
