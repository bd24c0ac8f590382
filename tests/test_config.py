"""Config validation: every rule of config.py's dataclasses raises ValueError naming the setting.
CPU only, < 1 s; run: pytest tests/test_config.py"""

import dataclasses
import re

import pytest

from track_1_short import config as config_mod
from track_1_short.config import DataConfig, TrainConfig


@pytest.mark.parametrize("kwargs,needle", [
    (dict(slices_per_step=0), "slices_per_step"),
    (dict(val_tokens_per_batch=64), "--val-tokens-per-batch"),
])
def test_data_config_rules(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DataConfig(**kwargs)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(optimizer="sgd"), "--optimizer"),
    (dict(device="tpu"), "--device"),
    (dict(max_steps=0), "--max-steps"),
    (dict(save_every=-1), "--save-every"),
    (dict(log_every=0), "--log-every"),
    (dict(profile_steps=(5, 5)), "--profile-steps 5:5"),
    (dict(profile_steps=(-1, 2)), "--profile-steps -1:2"),
    (dict(profile_steps=(0, 50)), "at most 20 steps"),
    (dict(update_norm_steps=(4, 4)), "--update-norms 4:4: needs 0 <= START < END"),
])
def test_train_config_rules(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        TrainConfig(**kwargs)


def test_run_config_rules():
    cfg = config_mod.preset("cpu-tiny")
    with pytest.raises(ValueError, match="--graphs on/check needs the compiled model"):
        dataclasses.replace(cfg, graphs=dataclasses.replace(cfg.graphs, mode="on"))
    small_model = dataclasses.replace(cfg.model, max_position=256)
    with pytest.raises(ValueError, match="max_position"):
        dataclasses.replace(cfg, model=small_model)


def test_cli_overrides_reach_the_tree():
    cfg = config_mod.parse(["--preset", "small-gpu", "--graphs", "check", "--check-fraction", "0.5",
                            "--no-fp8", "--max-steps", "7", "--data-seed", "3", "--val-every", "5"])
    assert cfg.graphs.mode == "check" and cfg.graphs.check_fraction == 0.5
    assert cfg.model.fp8.enabled is False and cfg.train.max_steps == 7
    assert cfg.data.seed == 3 and cfg.schedule.val_every_steps == 5
    assert [s.tokens_per_rank for s in cfg.schedule.stages] == [16384, 32768, 49152, 49152]


def test_one_cadence_source():
    """The Adam and n-gram cadences live once, in ScheduleConfig: --save-every is checked against
    the schedule's period, and the AdamW baseline (an update every step) gets adam_every 1."""
    from track_1_short.schedule import ScheduleConfig
    cfg = config_mod.preset("cpu-tiny")
    assert cfg.checkpoint_period == 2
    odd = dataclasses.replace(cfg.schedule, adam_every=3)
    assert dataclasses.replace(cfg, schedule=odd).checkpoint_period == 6
    with pytest.raises(ValueError, match="--save-every 4: .* every 6 steps.*--save-every 6"):
        dataclasses.replace(cfg, schedule=odd, train=dataclasses.replace(cfg.train, save_every=4))
    adamw = config_mod.parse(["--optimizer", "adamw"])
    assert adamw.schedule.adam_every == 1 and adamw.checkpoint_period == 2
    with pytest.raises(ValueError, match="ScheduleConfig.adam_every must be 1"):
        dataclasses.replace(cfg, schedule=ScheduleConfig(stages=cfg.schedule.stages),
                            train=dataclasses.replace(cfg.train, optimizer="adamw"))
    assert not hasattr(cfg.optim, "adam_every") and not hasattr(cfg.model.ngram, "cycle")


def test_set_reaches_any_scalar_field_after_the_other_flags():
    cfg = config_mod.parse([
        "--preset", "small-gpu", "--max-steps", "7", "--set", "model.attn_out_init=uniform",
        "--set", "model.ngram.trigram_rows=1000", "--set", "optim.lr=0.02",
        "--set", "model.fp8.enabled=true", "--set", "model.long_window_layers=3,10",
        "--set", "train.max_steps=none", "--set", "data.data_dir=/tmp/x"])
    assert cfg.model.attn_out_init == "uniform" and cfg.model.ngram.trigram_rows == 1000
    assert cfg.optim.lr == 0.02 and cfg.model.fp8.enabled is True
    assert cfg.model.long_window_layers == (3, 10) and cfg.train.max_steps is None  # after --max-steps
    assert str(cfg.data.data_dir) == "/tmp/x"
    assert config_mod.preset("small-gpu").model.attn_out_init == "zero"  # the preset is untouched


@pytest.mark.parametrize("item,needle", [
    ("model.nope=1", r"model has no field 'nope' \(fields: .*attn_out_init"),
    ("nope.x=1", "the run config has no field 'nope'"),
    ("model.ngram.trigram_rows=abc", "trigram_rows=abc: not a valid int"),
    ("model.fp8.enabled=maybe", "not a valid bool"),
    ("model", "expected SECTION.FIELD=VALUE"),
    ("model.ngram.dtype=float16", "cannot be set from the command line"),
    ("data=3", r"a section \(DataConfig\), not a field"),
    ("model.ngram.trigram_rows=1", "NgramConfig.trigram_rows=1 must be >= 2"),  # re-validated
    ("model.attn_out_init=normal", "GPTConfig.attn_out_init='normal'"),
    ("train.fused_loss_schedule=one_pass --no-fused-loss", "fused_loss_schedule=one_pass is a schedule of the fused loss"),
    ("train.fused_loss_schedule=three_pass", r"fused_loss_schedule='three_pass': one of \('auto', 'two_pass'"),
    ("train.fused_loss_schedule=recompute", "recompute is the fp8 lm head's"),
    ("train.fused_loss_schedule=recompute --fp8 --set model.fp8.sites=mlp_up", "recompute is the fp8 lm head's"),
    ("train.ngram_accumulate=atomic", r"ngram_accumulate='atomic': one of \('auto', 'index_add', 'vector_atomic', 'sorted'\)"),
    ("train.embed_grad=sparse", r"train.embed_grad='sparse': one of \('pull', 'dense'\)"),
])
def test_set_refuses_bad_items_with_exit_2_naming_them(item, needle, capsys):
    item, *flags = item.split(" ")
    with pytest.raises(SystemExit) as e:
        config_mod.parse(["--preset", "small-gpu", "--set", item, *flags])
    assert e.value.code == 2
    assert re.search(needle, capsys.readouterr().err)


def test_inductor_options_reach_the_training_forward_only(monkeypatch):
    """TrainConfig.max_autotune, coordinate_descent_tuning and inductor_pdl: inductor's options
    max_autotune, coordinate_descent_tuning and triton.enable_pdl on the training forward's
    compile (eval_ce compiles without them); each needs the compiled model with the inductor
    backend."""
    import torch

    from track_1_short.model.gpt import GPT, GPTConfig
    from track_1_short.trainer import build

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    model = GPT(GPTConfig.tiny())
    for autotune, cdt, pdl in ((False, False, False), (True, False, False), (False, True, False),
                               (False, False, True), (True, True, True)):
        calls.clear()
        train = TrainConfig(max_autotune=autotune, coordinate_descent_tuning=cdt, inductor_pdl=pdl)
        forward_fn, eval_fn = build.compile_model(model, train)
        expect = {**({"max_autotune": True} if autotune else {}),
                  **({"coordinate_descent_tuning": True} if cdt else {}),
                  **({"triton.enable_pdl": True} if pdl else {})} or None
        assert [c.get("options") for c in calls] == [expect, None]
        assert all(c["fullgraph"] and c["dynamic"] is False for c in calls)
    calls.clear()
    assert build.compile_model(model, TrainConfig(compile=False)) == (model, model.eval_ce) and not calls
    for bad in (dict(compile=False), dict(compile_backend="aot_eager")):
        for name in ("max_autotune", "coordinate_descent_tuning", "inductor_pdl"):
            with pytest.raises(ValueError, match=f"{name} needs the compiled model"):
                TrainConfig(**{name: True}, **bad)


def test_every_trainer_flag_has_a_row_in_the_readme():
    """README.md's "Trainer flags" table names every flag the trainer's parser takes (so a new
    flag cannot land undocumented), and names no flag the parser lacks."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## Trainer flags"):readme.index("## Runs, checkpoints")]
    parser_flags = {o for a in config_mod.build_parser()._actions for o in a.option_strings
                    if o.startswith("--") and o != "--help"}
    assert sorted(f for f in parser_flags if f not in table) == []
    rows = {f for line in table.splitlines() if line.startswith("| `--")
            for f in re.findall(r"`(--[a-z0-9-]+)", line.split(" | ")[0])}
    assert sorted(rows - parser_flags) == []
