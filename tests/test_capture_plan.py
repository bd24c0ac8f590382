"""Capture plan: keys from the schedule and the derived warmup visit plan.

CPU only, pure Python, < 1 s: `.venv/bin/python -m pytest tests/test_capture_plan.py -q`.
"""

import dataclasses

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
