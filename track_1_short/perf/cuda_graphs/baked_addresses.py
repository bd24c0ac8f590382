"""Census of every address the step graphs bake: (role, data_ptr, shape, dtype), compared as a contract.

What it replaces: trusting that nothing between capture and the timed run moved a tensor a graph
reads. A replay reads and writes the raw addresses the capture saw; if anything rebinds one (a
`p.data = ...`, a reset that re-allocates YaRN tables the way modded-nanogpt's `Yarn.reset()`
does, a `load_state_dict` that assigns instead of copying, a new n-gram sink), the graph silently
keeps using the old memory: wrong results with no error (cuda_graph_anchors.md section 4, pain
point 4: vLLM #48941, TransformerEngine PRs #2044 and #869). PyTorch checks only slices of this
(opt-in liveness of external inputs); this is the whole set, anchors section 5 item 3.

What it covers: every named parameter and every named buffer of the model and every
`step_runner.baked_tensors()` entry (static inputs, n-gram sinks and ring, value_embeds'
grad_accum, the persistent gradient accumulators), and every entry of the further sources passed
after it (OptimizerGraphs.baked_tensors(): the optimizer's state tensors, step values, masters, lr
multipliers and the gradient buffers its graphs read).

Call order: train.py after the warmup: `before = take_census(model, runner, optimizer)`,
post-warmup reset (in place), `compare(before, take_census(model, runner, optimizer))` (fatal
CensusError naming each changed role), then `runner.seal()`, `optimizer.seal()`;
`census.to_json()` goes to the run log. Cheap (a Python walk, no device work).

Provenance: DESIGN.md section 4 "Census"; the seed's `baked_tensors()` contract.
Deviations: none.
"""

import json
from dataclasses import dataclass, field

from torch import Tensor, nn


class CensusError(RuntimeError):
    """An address a step graph baked changed: replays would read or write stale memory."""


@dataclass(slots=True, frozen=True)
class CensusEntry:
    data_ptr: int
    shape: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        return f"ptr {self.data_ptr:#x} shape {list(self.shape)} {self.dtype}"


@dataclass(slots=True)
class Census:
    """Concern: the set of baked addresses at one moment, by role (compared as a contract)."""

    entries: dict[str, CensusEntry] = field(default_factory=dict)  # role -> entry

    def add(self, role: str, tensor: Tensor) -> None:
        if role in self.entries:
            raise CensusError(f"census: role {role!r} listed twice")
        self.entries[role] = CensusEntry(tensor.data_ptr(), tuple(tensor.shape), str(tensor.dtype))

    def to_json(self) -> str:
        return json.dumps({role: {"data_ptr": e.data_ptr, "shape": list(e.shape), "dtype": e.dtype}
                           for role, e in self.entries.items()}, sort_keys=True)


def take_census(model: nn.Module, step_runner, *more_sources) -> Census:
    """Snapshot of every address the graphs depend on (`step_runner`: StepGraphs or EagerStep;
    `more_sources`: e.g. OptimizerGraphs or EagerOptimizer; anything with baked_tensors(). All
    sources share the "baked:" prefix, so a role listed by two of them is an error)."""
    census = Census()
    for name, param in model.named_parameters():
        census.add(f"param:{name}", param)
    for name, buffer in model.named_buffers():
        census.add(f"buffer:{name}", buffer)
    for source in (step_runner, *more_sources):
        for role, tensor in source.baked_tensors():
            census.add(f"baked:{role}", tensor)
    return census


def compare(before: Census, after: Census) -> None:
    """Raise CensusError naming every changed, missing and added role (old vs new)."""
    problems = []
    for role, old in before.entries.items():
        new = after.entries.get(role)
        if new is None:
            problems.append(f"missing {role}: was {old.describe()}")
        elif new != old:
            problems.append(f"changed {role}: {old.describe()} -> {new.describe()}")
    for role in after.entries.keys() - before.entries.keys():
        problems.append(f"added {role}: {after.entries[role].describe()}")
    if problems:
        raise CensusError(f"{len(problems)} baked address(es) moved since the census; the step "
                          f"graphs would use stale memory (reset in place: copy_, zero_, fill_):\n  "
                          + "\n  ".join(problems))
