"""Capture plan: keys from the schedule and the derived warmup visit plan.

CPU only, pure Python, ~2 s (the phases import): `.venv/bin/python -m pytest tests/test_capture_plan.py -q`.
"""

import dataclasses

import pytest

from track_1_short.perf.cuda_graphs.capture_plan import (StepGraphKey, cadence_span, describe_plan,
                                                         key_uses, step_keys, warmup_visit_plan)
from track_1_short.schedule import SPEEDRUN_STAGES, Schedule, ScheduleConfig

SPEEDRUN = Schedule(ScheduleConfig())


def test_speedrun_keys():
    """The speedrun's four keys, with document capacities as the preflight resolves them from the
    data (here the record's 64/96/128; the presets leave them None)."""
    stages = tuple(dataclasses.replace(s, cu_seqlens_rows=rows)
                   for s, rows in zip(SPEEDRUN_STAGES, (64, 96, 128, 128)))
    resolved = Schedule(ScheduleConfig(stages=stages))
    keys = step_keys(resolved)
    assert len(keys) == SPEEDRUN.num_steps
    distinct = list(dict.fromkeys(keys))
    assert distinct == [
        StepGraphKey(16384, 64, 3, 128, 384, 896),
        StepGraphKey(32768, 96, 2, 384, 896, 2048),
        StepGraphKey(49152, 128, 1, 640, 1408, 2048),
        StepGraphKey(49152, 128, 1, 768, 1664, 2048),
    ]
    for step, key in enumerate(keys):
        assert key == distinct[resolved.plan(step).stage_index]
    assert hash(keys[0]) == hash(tuple(keys[0])) and tuple(keys[0])[0] == 16384


def test_speedrun_visit_plan_is_the_records_list():
    assert warmup_visit_plan(SPEEDRUN) == [0, 1, 421, 422, 423, 424, 845, 846, 847, 848, 1268,
                                           1269, 1270, 1271]


def _check_plan(schedule: Schedule):
    keys, visits = step_keys(schedule), warmup_visit_plan(schedule)
    assert visits == sorted(set(visits)) and all(0 <= s < schedule.num_steps for s in visits)
    for use in key_uses(keys, visits):
        assert len(use.visits) >= 2, use
    # the first visits run a whole Adam window (opened, added to, updated) and a whole n-gram
    # cycle from no held gradient to its event, by the plan
    plans = [schedule.plan(s) for s in range(schedule.num_steps)]
    first_adam = next(p.step for p in plans if p.adam_step)
    first_event = next(p.step for p in plans if p.ngram_event)
    assert set(range(max(first_adam, first_event) + 1)) <= set(visits)
    assert plans[0].adam_first and not any(p.adam_first for p in plans[1:first_adam + 1])
    for transition in schedule.transitions():
        assert {transition.step - 1, transition.step} <= set(visits)
    return keys, visits


def test_plan_covers_cadences_and_transitions():
    _check_plan(SPEEDRUN)
    _check_plan(Schedule(ScheduleConfig(adam_every=3, ngram_cycle=4)))
    assert cadence_span(SPEEDRUN) == 2
    assert cadence_span(Schedule(ScheduleConfig(adam_every=3, ngram_cycle=4))) == 4
    assert cadence_span(Schedule(ScheduleConfig(adam_every=5, ngram_cycle=1))) == 5


def test_short_stage_still_visited_twice():
    stages = list(SPEEDRUN_STAGES)
    stages.insert(1, dataclasses.replace(SPEEDRUN_STAGES[1], name="B0", num_steps=2, ws_short=256))
    keys, visits = _check_plan(Schedule(ScheduleConfig(stages=tuple(stages))))
    assert len(set(keys)) == 5


def test_describe_plan_lists_every_key():
    keys, visits = step_keys(SPEEDRUN), warmup_visit_plan(SPEEDRUN)
    text = describe_plan(SPEEDRUN, keys, visits)
    assert "4 keys over 1285 steps" in text
    assert "1270,1271" in text and "0,1,421,422" in text
    assert len(text.splitlines()) == 6


def test_truncated_run_plans_only_reached_keys():
    keys = step_keys(SPEEDRUN, num_steps=424)
    assert len(keys) == 424 and len(set(keys)) == 2
    visits = warmup_visit_plan(SPEEDRUN, num_steps=424)
    assert visits == [0, 1, 421, 422, 423, 423]  # key B serves one step: visited there twice
    assert [len(use.visits) for use in key_uses(keys, visits)] == [4, 2]


class _HeldGradients:
    """NgramStore's bound on held gradients (hold, num_pending, max_held, update_event), without
    the table: hold raises past cycle x micro_steps, as the store does."""

    def __init__(self, cycle: int, micro_steps: int):
        self.max_held, self.num_pending, self.events = cycle * micro_steps, 0, []

    def hold(self):
        if self.num_pending >= self.max_held:
            raise RuntimeError(f"{self.num_pending + 1} held n-gram gradients > {self.max_held}")
        self.num_pending += 1

    def update_event(self, step: int, lr_mul: float):
        self.num_pending = 0
        self.events.append(step)


def _warm_up(schedule: Schedule, micro_steps: int, flush) -> _HeldGradients:
    """train_step's n-gram half over the warmup visit plan (hold per micro-step, the event on the
    plan's event steps), then trainer/phases.py's gap flush after each visit."""
    from types import SimpleNamespace

    plans = [schedule.plan(s) for s in range(schedule.num_steps)]
    store = _HeldGradients(schedule.cfg.ngram_cycle, micro_steps)
    run = SimpleNamespace(parts=SimpleNamespace(ngram=store), spec=SimpleNamespace(plans=plans))
    visits = warmup_visit_plan(schedule)
    for i, step in enumerate(visits):
        for _ in range(micro_steps):
            store.hold()
        if plans[step].ngram_event:
            store.update_event(step, plans[step].lr_mul)
        flush(run, visits, i)
    return store


@pytest.mark.parametrize("micro_steps", [1, 4, 8])
def test_warmup_applies_held_ngram_gradients_at_every_gap_of_the_speedrun_plan(micro_steps):
    """The speedrun's visit plan jumps from step 848 to 1268, both without an n-gram event: the
    held gradients would pass the store's bound at 1269 (the first 2-GPU speedrun died there).
    trainer/phases._flush_gap applies them at every gap; without it the bound is passed (the same
    property tests/test_train.py's speedrun warmup scenario shows through main(), -m slow)."""
    from track_1_short.trainer.phases import _flush_gap

    schedule = Schedule(ScheduleConfig())
    store = _warm_up(schedule, micro_steps, _flush_gap)
    assert 848 in store.events and not schedule.plan(848).ngram_event  # flushed at the gap
    assert store.num_pending == 0  # the plan ends on the last step, an event
    with pytest.raises(RuntimeError, match="held n-gram gradients"):
        _warm_up(schedule, micro_steps, lambda run, visits, i: None)
