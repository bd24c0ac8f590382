"""Capture plan: the closed set of step-graph keys and the warmup steps that capture and check them.

What it replaces: PT2's open-ended re-recording (a new CUDA graph whenever a guard fails, silently
falling back when it gives up) and modded-nanogpt's hand-written warmup list
`[0, 1, 421, 422, 423, 424, 845, 846, 847, 848, 1268, 1269, 1270, 1271]` (train_gpt.py:2264-2301).
Here both come from the Schedule: `step_keys()` gives the key of every timed step (4 distinct keys
for the speedrun), and `warmup_visit_plan()` derives the warmup list (it reproduces the list above
for the speedrun) so that every key is visited at least twice: the first visit captures, the second
replays and self-checks (step_graphs.py). After warmup StepGraphs.seal() turns the key set into a
contract: a key without a checked capture is fatal, never a silent eager step or a recompile.

Why this is cheaper than the alternatives: every capture is paid in the untimed warmup (compile
~90 s for the first key, ~80 s per further key on the H200, facts section 8); the timed run only
replays. A key is what the compiled model specializes on: shapes (tokens, cu_seqlens length, MTP
targets) and the Python ints it bakes (windows, max_seq_len).

What must stay stable: the key derivation must agree with step_runner.live_key() on a real batch;
both read the same fields, and StepGraphs.forward() raises when they disagree.

Call order: train.py, before warmup: `keys = step_keys(schedule)`, `visits =
warmup_visit_plan(schedule)`, prints `describe_plan(schedule, keys, visits)`; keys go to
StepGraphs, visits drive the warmup loop (the same train_step as the timed run).

Provenance: facts sections 3 and 5 (4 keys, warmup list of s-2..s+1 around each transition).
Deviations: the list is derived, not written out; the span around each transition widens with the
plan's cadences (`cadence_span`: through the first Adam step and the first n-gram event), so a
whole Adam accumulation window (copy, adds, update) and a whole n-gram cycle (its held gradients
from none to the event) are exercised.
"""

from dataclasses import dataclass
from typing import NamedTuple

from track_1_short.schedule import Schedule


class StepGraphKey(NamedTuple):
    """What the compiled model specializes on. Hashable and iterable (tuple(key) is stable)."""

    tokens: int  # T per rank per micro-step
    cu_seqlens_rows: int  # fixed length of cum_seqlens (padded with zero-length documents)
    mtp_targets: int  # number of multi-token-prediction weights
    ws_short: int
    ws_long: int
    max_seq_len: int


def step_keys(schedule: Schedule, *, num_steps: int | None = None) -> list[StepGraphKey]:
    """The key of every training step, indexed by step. `num_steps` (default: the whole schedule)
    truncates a shortened run (--max-steps), so seal() only demands the keys it reaches."""
    keys = []
    for step in range(schedule.num_steps if num_steps is None else num_steps):
        plan = schedule.plan(step)
        keys.append(StepGraphKey(
            tokens=plan.tokens_per_rank, cu_seqlens_rows=plan.cu_seqlens_rows,
            mtp_targets=len(plan.mtp_weights), ws_short=plan.ws_short, ws_long=plan.ws_long, max_seq_len=plan.max_seq_len))
    return keys


def cadence_span(schedule: Schedule) -> int:
    """Steps from step 0 through the later of the plan's first Adam step and first n-gram event
    (at least 2): those steps open an Adam window, add into it and update (every step kind the
    handoff and the optimizer have), and hold n-gram gradients from none to their event."""
    steps = range(schedule.num_steps)
    first_adam = next((s for s in steps if schedule.plan(s).adam_step), schedule.num_steps - 1)
    first_event = next(s for s in steps if schedule.plan(s).ngram_event)  # the last step has one
    return max(2, first_adam + 1, first_event + 1)


def warmup_visit_plan(schedule: Schedule, *, num_steps: int | None = None) -> list[int]:
    """Sorted steps the untimed warmup runs (each a full train_step with its optimizer step).

    Covers: the first `span` steps (cadence_span: a whole Adam window and a whole n-gram cycle, so
    every ring slot is used), `span` steps on each side of every stage transition (the YaRN/window
    changes, the old key's last steps and the new key's first), and at least two visits of every
    key. Only steps < num_steps (default: the whole schedule); a key that serves a single step
    there is visited at that step twice (the list then holds the step twice).
    """
    limit = schedule.num_steps if num_steps is None else num_steps
    span = cadence_span(schedule)
    visits = set(range(min(span, limit)))
    for transition in schedule.transitions():
        visits.update(range(max(0, transition.step - span), min(limit, transition.step + span)))
    keys = step_keys(schedule, num_steps=limit)
    repeats = []
    for key in dict.fromkeys(keys):
        served = [step for step, k in enumerate(keys) if k == key]
        missing = 2 - sum(1 for step in served if step in visits)
        for step in served:
            if missing <= 0:
                break
            if step not in visits:
                visits.add(step)
                missing -= 1
        if missing > 0:
            repeats.append(served[0])
    return sorted([*visits, *repeats])


@dataclass(slots=True, frozen=True)
class KeyUse:
    """How one key is used: by the timed run (steps served) and by the warmup (visits)."""

    key: StepGraphKey
    num_steps: int
    first_step: int
    last_step: int
    visits: tuple[int, ...]


def key_uses(keys: list[StepGraphKey], visits: list[int]) -> list[KeyUse]:
    """One KeyUse per distinct key, in order of first use."""
    out = []
    for key in dict.fromkeys(keys):
        served = [step for step, k in enumerate(keys) if k == key]
        out.append(KeyUse(key=key, num_steps=len(served), first_step=served[0],
                          last_step=served[-1],
                          visits=tuple(step for step in visits if keys[step] == key)))
    return out


def describe_plan(schedule: Schedule, keys: list[StepGraphKey], visits: list[int]) -> str:
    """Human-readable table printed at start: one row per key."""
    header = ("tokens", "cu", "mtp", "ws_s", "ws_l", "msl", "steps", "first", "last",
              "warmup visits")
    rows = [header]
    for use in key_uses(keys, visits):
        rows.append((*map(str, use.key), str(use.num_steps), str(use.first_step),
                     str(use.last_step), ",".join(map(str, use.visits))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.append(f"{len(set(keys))} keys over {schedule.num_steps} steps; "
                 f"{len(visits)} warmup steps: {visits}")
    return "\n".join(lines)
