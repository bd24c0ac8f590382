"""Schedule: the speedrun's numbers (modded_nanogpt_facts.md section 3) and config validation.

CPU only, pure Python, < 1 s: `.venv/bin/python -m pytest tests/test_schedule.py -q`.
"""

import dataclasses

import pytest

from track_1_short.schedule import (MAX_CYCLE_STEPS, SPEEDRUN_STAGES, Schedule, ScheduleConfig,
                                    StageConfig)


@pytest.fixture(scope="module")
def speedrun() -> Schedule:
    return Schedule(ScheduleConfig())


def test_stage_boundaries(speedrun):
    assert speedrun.num_steps == 1285
    assert speedrun.num_scheduled_steps == 1270
    assert speedrun.stage_starts == (0, 423, 847, 1270)
    stages = [speedrun.plan(s).stage for s in (0, 422, 423, 846, 847, 1269, 1270, 1284)]
    assert stages == ["A", "A", "B", "B", "C", "C", "D", "D"]
    with pytest.raises(ValueError, match="outside the schedule"):
        speedrun.plan(1285)


@pytest.mark.parametrize("step, lr", [(0, 1.0), (422, 1.0), (507, 1.52), (508, 1.52), (846, 0.912),
                                      (847, 1.027), (1269, 0.152), (1270, 0.15), (1284, 0.15)])
def test_lr(speedrun, step, lr):
    assert speedrun.cooldown_start == 508
    assert speedrun.plan(step).lr_mul == pytest.approx(lr, abs=5e-4)


@pytest.mark.parametrize("step, momentum", [(0, 0.85), (150, 0.90), (300, 0.95), (800, 0.95),
                                            (1235, 0.95), (1260, 0.90), (1284, 0.95 - 0.1 * 49 / 50)])
def test_momentum(speedrun, step, momentum):
    assert speedrun.plan(step).momentum == pytest.approx(momentum)


def test_per_stage_values(speedrun):
    a, b, c, d = (speedrun.plan(s) for s in (0, 423, 847, 1270))
    assert (a.tokens_per_rank, a.ws_short, a.ws_long, a.max_seq_len) == (16384, 128, 384, 896)
    assert (b.tokens_per_rank, b.ws_short, b.ws_long, b.max_seq_len) == (32768, 384, 896, 2048)
    assert (c.tokens_per_rank, c.ws_short, c.ws_long) == (49152, 640, 1408)
    assert (d.tokens_per_rank, d.ws_short, d.ws_long) == (49152, 768, 1664)
    # document capacity: sized from the run's data at start (trainer/preflight.py)
    assert {a.cu_seqlens_rows, b.cu_seqlens_rows, c.cu_seqlens_rows, d.cu_seqlens_rows} == {None}
    assert a.mtp_weights == (1.0, 0.5, 0.25) and a.prefix_weight == 0.25
    assert speedrun.plan(211).mtp_weights[2] == pytest.approx(0.125, abs=1e-3)
    assert b.mtp_weights == (1.0, 0.5) and b.prefix_weight == 0.25
    assert speedrun.plan(634).mtp_weights[1] == pytest.approx(0.25, abs=2e-3)
    assert c.mtp_weights == (1.0,) and c.prefix_weight == 0.0
    assert speedrun.final_validation_windows() == (768, 2560)


def test_windows_and_transitions(speedrun):
    assert [(t.step, t.old_stage, t.new_stage) for t in speedrun.transitions()] == \
        [(423, "A", "B"), (847, "B", "C"), (1270, "C", "D")]
    changes = [(s, speedrun.plan(s - 1).ws_long, speedrun.plan(s).ws_long)
               for s in range(1, speedrun.num_steps)
               if speedrun.plan(s).ws_long != speedrun.plan(s - 1).ws_long]
    assert changes == [(423, 384, 896), (847, 896, 1408), (1270, 1408, 1664)]


def test_cadences(speedrun):
    plans = [speedrun.plan(s) for s in range(4)]
    assert [p.ngram_event for p in plans] == [False, True, False, True]
    assert [p.adam_step for p in plans] == [False, True, False, True]  # Adam on odd steps
    assert [p.adam_first for p in plans] == [True, False, True, False]
    assert [p.nothing_held for p in plans] == [False, True, False, True]
    last = speedrun.plan(1284)
    assert last.ngram_event  # the last step flushes held n-gram gradients
    assert not last.adam_step and not last.nothing_held  # an even step: Adam's window stays open
    assert speedrun.checkpoint_period == 2
    assert [s for s in range(1285) if speedrun.plan(s).validate] == [0, 250, 500, 750, 1000, 1250]


def test_cadences_follow_the_config():
    schedule = Schedule(ScheduleConfig(adam_every=3, ngram_cycle=4))
    plans = [schedule.plan(s) for s in range(schedule.num_steps)]
    assert [p.step for p in plans if p.adam_step][:3] == [2, 5, 8]
    assert [p.step for p in plans if p.adam_first][:3] == [0, 3, 6]
    assert [p.step for p in plans if p.ngram_event][:3] == [3, 7, 11]
    assert schedule.checkpoint_period == 12
    # nothing is held after step s exactly where (s + 1) is a multiple of the period, or at the
    # end when the forced last event falls on an Adam step (1284 is none: 1284 % 3 == 0)
    assert [p.step for p in plans if p.nothing_held] == \
        [s for s in range(schedule.num_steps) if (s + 1) % 12 == 0]


def _stage(**overrides) -> StageConfig:
    return dataclasses.replace(SPEEDRUN_STAGES[0], **overrides)


@pytest.mark.parametrize("overrides, field", [
    ({"ws_short": 100}, "ws_short"),
    ({"ws_long": 200}, "ws_long"),
    ({"ws_short": 512, "ws_long": 384}, "ws_short"),
    ({"mtp_weights_end": (1.0, 0.5)}, "mtp_weights_start"),
    ({"num_steps": 0}, "num_steps"),
    ({"max_seq_len": 20000}, "max_seq_len"),
    ({"cu_seqlens_rows": 1}, "cu_seqlens_rows"),
])
def test_bad_stage(overrides, field):
    with pytest.raises(ValueError, match=field):
        _stage(**overrides)


@pytest.mark.parametrize("overrides, field", [
    ({"ngram_cycle": MAX_CYCLE_STEPS + 1}, "ngram_cycle"),
    ({"ngram_cycle": 0}, "ngram_cycle"),
    ({"cooldown_frac": 1.5}, "cooldown_frac"),
    ({"adam_every": 0}, "adam_every"),
    ({"momentum_min": 0.99}, "momentum_min"),
    ({"momentum_max": 1.0}, "momentum_max"),
    ({"momentum_warmup_steps": -1}, "momentum_warmup_steps"),
    ({"final_val_ws_long": 2500}, "final_val_ws_long"),
    ({"stages": ()}, "stages"),
    ({"stages": (SPEEDRUN_STAGES[3], SPEEDRUN_STAGES[0])}, "extension"),
])
def test_bad_schedule(overrides, field):
    with pytest.raises(ValueError, match=field):
        ScheduleConfig(**overrides)

