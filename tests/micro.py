"""Small trainer configs shared by the CPU trainer tests (not a test module).

micro_config: 4 layers, d=64, two stages of 6 steps (T=128, then 256), 2 slices per step.
nano_config: the same schedule at T=64, d=16 and 3 layers, one slice per step, for tests that
run many short trainings (fault injection): its checkpoint is ~5x smaller and its steps ~4x faster.
"""

import dataclasses
from pathlib import Path

from track_1_short.config import DataConfig, RunConfig, TrainConfig
from track_1_short.model.gpt import GPTConfig
from track_1_short.ngram_table import NgramConfig
from track_1_short.optim.anvil_config import AnvilConfig
from track_1_short.perf.cuda_graphs.step_graphs import StepGraphsConfig
from track_1_short.schedule import ScheduleConfig, StageConfig


def micro_config(data_dir: Path, runs_dir: Path, run_id: str, **train_kw) -> RunConfig:
    common = dict(tokens_per_rank=128, max_seq_len=128, cu_seqlens_rows=8, prefix_weight_end=0.0,
                  mtp_weights_end=(1.0, 0.0), lr_mul=1.0)
    stages = (StageConfig(name="A", num_steps=6, ws_short=128, ws_long=128, mtp_weights_start=(1.0, 0.5),
                          prefix_weight_start=0.25, **common),
              # B's steps are larger (as in the speedrun), so a batch of the wrong stage is caught
              StageConfig(name="B", num_steps=6, ws_short=128, ws_long=256, mtp_weights_start=(1.0, 0.0),
                          prefix_weight_start=0.0, **{**common, "tokens_per_rank": 256}))
    model = GPTConfig.tiny(num_layers=4, model_dim=64, num_heads=2, head_dim=32, mlp_hidden=128,
                           long_window_layers=(3,), paired_head_layers=(0,), no_attention_layer=2,
                           skip_from_layer=1, value_embed_layers=(1, 3), max_position=1024,
                           ngram=NgramConfig(dim=64, bigram_rows=512, trigram_rows=512, cache_rows=1024))
    return RunConfig(
        preset="test", model=model,
        schedule=ScheduleConfig(stages=stages, momentum_warmup_steps=4, momentum_cooldown_steps=2,
                                val_every_steps=4, final_val_ws_long=256),
        optim=AnvilConfig(),
        graphs=StepGraphsConfig(mode="off"),
        data=DataConfig(data_dir=data_dir, slices_per_step=2, val_tokens=2048, val_tokens_per_batch=256,
                        val_cu_seqlens_rows=32),
        train=TrainConfig(**{"compile": False, "device": "cpu", "runs_dir": runs_dir,
                             "run_id": run_id, "log_every": 1, **train_kw}))


def nano_config(data_dir: Path, runs_dir: Path, run_id: str, **train_kw) -> RunConfig:
    """micro_config's schedule at T=64 in both stages, one slice per step, 512 validation tokens,
    with a d=16, 3-layer model: steps are mostly the real vocab's softmax."""
    cfg = micro_config(data_dir, runs_dir, run_id, **train_kw)
    cfg.schedule.stages = tuple(dataclasses.replace(s, tokens_per_rank=64, max_seq_len=64)
                                for s in cfg.schedule.stages)
    cfg.data.slices_per_step, cfg.data.val_tokens = 1, 512
    cfg.model = GPTConfig.tiny(num_layers=3, model_dim=16, num_heads=2, head_dim=8, mlp_hidden=32,
                               long_window_layers=(2,), paired_head_layers=(0,), no_attention_layer=1,
                               skip_from_layer=0, value_embed_layers=(2,), max_position=1024,
                               ngram=NgramConfig(dim=16, bigram_rows=64, trigram_rows=64, cache_rows=1024))
    return cfg
