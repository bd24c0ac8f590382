"""Smoke tests of the GPU benchmarks bench/model.py, bench/step_graphs.py, bench/optimizer.py and
bench/loss_kernel.py, bench/step.py, bench/ngram_hold.py, bench/ngram_event.py and
bench/qk_norm_rope.py, so they do not rot.

Scope: both scripts run end to end with --smoke (CPU, GPTConfig.tiny() with a 512-token vocabulary,
tiny shapes, 2 timed steps, no compile; step_graphs drives the real StepGraphs over the
RecordingGraphBackend stand-in and the real EagerStep, with a real AnvilAndAdam) in subprocesses
(their process-wide settings stay out of this pytest process), and write complete JSON with the
command, every key and variant, computed goals and the model JSON from the eager variant;
optimizer.py (--smoke: the tiny model, compile off and on, the latter on aot_eager) writes even and
odd step times per mode, every unit's time and no recompile in its timed steps. Plus the
FLOPs arithmetic and the synthetic batch's packing invariants, checked directly. loss_kernel.py
and qk_norm_rope.py --smoke run their kernels in the Triton interpreter (the process sets
TRITON_INTERPRET=1 before importing triton; needs triton installed); qk_norm_rope.py also loads
this checkout's kernel file as its --baseline-kernel.
Hardware: CPU; ~30 s on 2 busy cores, plus ~30 s for loss_kernel (marked slow).
Run: `.venv/bin/python -m pytest tests/test_bench_smoke.py -q`.
"""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import common
from bench import model as model_bench
from track_1_short.data import TrainStream, list_shards, write_shard
from track_1_short.perf import profiling
from track_1_short.model.gpt import GPTConfig

REPO = Path(__file__).resolve().parents[1]
KEYS = {"A_half", "A", "B", "C", "D"}


def _run(script: str, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, f"bench/{script}", "--smoke", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_model_bench_smoke(tmp_path):
    out = tmp_path / "model.json"
    _run("model.py", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["complete"] and "--smoke" in data["command"] and not data["errors"]
    assert set(data["keys"]) == {"A", "B", "C", "D"}
    for row in data["keys"].values():
        assert row["median_ms"] > 0 and row["n"] == 2 and row["recompiles_timed"] == 0
        assert row["model_flops"] > row["dense_flops"] > 0 and row["mfu"] > 0
    assert set(data["goals"]) == {"mfu_C_ge_35pct", "ms_C_le_100", "no_recompiles"}


def test_ngram_hold_bench_smoke(tmp_path):
    out = tmp_path / "hold.json"
    _run("ngram_hold.py", "--steps", "3", "--out", str(out))
    data = json.loads(out.read_text())
    assert "--smoke" in data["command"] and data["tokens_per_micro_step"] == 64
    assert set(data["ops_ms"]) == {"row_ids", "slots_for", "hold", "index_add", "index_fill",
                                   "index_put_accumulate", "index_add_sorted", "copy"}
    assert all(op["n"] == 3 and op["median_ms"] > 0 for op in data["ops_ms"].values())
    assert 0 < data["distinct_rows_per_micro_step"] <= 2 * 64 <= data["rows"]


def test_ngram_event_bench_smoke(tmp_path):
    out = tmp_path / "event.json"
    _run("ngram_event.py", "--events", "3", "--held", "2", "--out", str(out))
    data = json.loads(out.read_text())
    assert "--smoke" in data["command"] and data["held_micro_steps"] == 2
    assert list(data["variants"]) == ["reference"]  # the kernels need CUDA
    ref = data["variants"]["reference"]
    assert ref["event_ms"]["n"] == 3 and ref["event_ms"]["median_ms"] > 0
    assert 0 < data["touched_rows"] <= 2 * 2 * 64 and ref["max_abs_diff_vs_first"] == 0.0
    env = dict(os.environ, PYTHONPATH=str(REPO))
    bad = subprocess.run([sys.executable, "bench/ngram_event.py", "--smoke", "--baseline-kernel",
                          "x.py", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--baseline-kernel needs a CUDA GPU" in bad.stderr


def test_qk_norm_rope_bench_smoke(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "qk.json"
    _run("qk_norm_rope.py", "--stages", "A", "--calls", "2", "--tilings", "16x4,8x1",
         "--baseline-kernel", "track_1_short/kernels/qk_norm_rope.py", "--out", str(out))
    data = json.loads(out.read_text())
    assert "--smoke" in data["command"] and set(data["cases"]) == {"A_paired", "A_unpaired"}
    for case in data["cases"].values():
        assert list(case["variants"]) == ["tile_16x4", "tile_8x1", "baseline"]
        for v in case["variants"].values():
            assert v["max_abs_diff_vs_first"] == 0.0
            assert v["forward"]["ms"] > 0 and v["backward"]["ms"] > 0
        assert case["floor_bytes"]["backward"] > case["floor_bytes"]["forward"] > 0
    env = dict(os.environ, PYTHONPATH=str(REPO))
    bad = subprocess.run([sys.executable, "bench/qk_norm_rope.py", "--smoke", "--tilings", "3x4",
                          "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--tilings '3x4'" in bad.stderr


def test_step_graphs_bench_smoke(tmp_path):
    out, model_out = tmp_path / "sg.json", tmp_path / "sg_model.json"
    _run("step_graphs.py", "--out", str(out), "--also-model-json", str(model_out))
    data = json.loads(out.read_text())
    assert data["complete"] and "--smoke" in data["command"]
    # reduce-overhead is CUDA only: recorded as skipped, nothing else may fail
    assert set(data["errors"]) == {"reduce-overhead"}, data["errors"]
    assert set(data["results"]) == KEYS
    for variants in data["results"].values():
        assert set(variants) == {"eager", "graphs"}
        for row in variants.values():
            assert row["wall_ms"] > 0 and row["n"] == 2 and row["recompiles_timed"] == 0
    assert data["sealed"] is True
    report = data["capture_report"]
    assert len(report) == len(KEYS) and all(r["self_checks"] >= 1 for r in report)
    assert data["speedups"]["A_half"]["graphs_over_eager"] > 0
    assert isinstance(data["goals"]["graphs_never_slower_than_eager"], bool)
    assert data["goals"]["graphs_gpu_busy_ge_99pct"] is None  # no profiler on CPU
    model = json.loads(model_out.read_text())
    assert model["complete"] and set(model["keys"]) == KEYS
    assert "eager variant" in model["source"]


@pytest.mark.parametrize("tied", [False, True])
def test_optimizer_bench_smoke(tmp_path, tied):
    out = tmp_path / "opt.json"
    _run("optimizer.py", *([] if tied else ["--untied"]), "--warmup", "2", "--steps", "4",
         "--out", str(out))
    data = json.loads(out.read_text())
    assert data["complete"] and "--smoke" in data["command"] and not data["errors"]
    assert set(data["modes"]) == {"off", "on"} and data["shapes"]["mlp_bank"] == [8, 2, 512, 128]
    for mode, row in data["modes"].items():
        assert row["compiled"] == (mode == "on") and row["compiles"]["timed"] == 0
        assert {k: r["n"] for k, r in row["step_ms"].items()} == {"even": 2, "odd": 2}
        tables = {"lm_head", "tied_fold", "tied_copy"} if tied else {"embed.weight", "lm_head"}
        assert set(row["unit_ms"]) == {"qk_bank", "vo_bank", "mlp_bank", "value_embeds.weight",
                                       "adam_group", *tables}
        assert all(r["median_ms"] > 0 for r in [*row["step_ms"].values(), *row["unit_ms"].values()])
    assert data["modes"]["on"]["compiles"]["warmup"] > 0
    assert set(data["compiled_over_eager"]) == {"even", "odd"}


def test_loss_kernel_sweep_rows_are_launch_configs():
    """Every --sweep row of bench/loss_kernel.py builds a LaunchConfig (a row that the config
    refuses would only fail in a device call); the recompute forward's rows are there."""
    pytest.importorskip("triton")
    from bench import loss_kernel
    from track_1_short.kernels import softcap_ce

    pad = len(softcap_ce.LAUNCH_FIELDS)
    launches = [softcap_ce.LaunchConfig.from_op_args(*row, *(False,) * (pad - len(row)))
                for row in loss_kernel.SWEEP]
    assert len(set(launches)) == len(launches)  # no row twice
    assert sum(launch.recompute for launch in launches) >= 5


@pytest.mark.slow
def test_loss_kernel_bench_smoke(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "lk.json"
    _run("loss_kernel.py", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["complete"] and "--smoke" in data["command"] and not data["errors"]
    assert data["settings"]["interpreted"] is True and set(data["keys"]) == {"A", "C"}
    for row in data["keys"].values():
        assert set(row["variants"]) == {"torch", "fused", "gemms", "kernel"}
        assert all(v["median_ms"] > 0 and v["n"] == 2 for v in row["variants"].values())
        fused, scale = row["errors"]["fused"], row["errors"]["loss_scale"]
        assert fused["loss_max_abs"] < 1e-5 * scale and max(fused["dx_rel"], fused["dw_rel"]) < 1e-2


def test_step_bench_smoke(tmp_path):
    """bench/step.py --smoke: the trainer's real step at one stage (cpu-tiny, eager, no
    validation): per-step and per-phase times by parity, host issue time, no recompile; --set
    items reach the run's config."""
    out = tmp_path / "step.json"
    _run("step.py", "--stage", "B", "--steps", "2", "--graphs", "off",
         "--set", "model.ngram.update=dense", "--set", "model.long_window_layers=1,5",
         "--data-dir", str(REPO / "data" / "embedded"), "--profile", "--trace-dir", str(tmp_path / "traces"),
         "--out", str(out))
    data = json.loads(out.read_text())
    assert data["complete"] and not data["errors"] and set(data["variants"]) == {"off"}
    row = data["variants"]["off"]
    assert data["config_set"] == ["model.ngram.update=dense", "model.long_window_layers=1,5"]
    assert row["config_values"] == {"model.ngram.update": "dense", "model.long_window_layers": [1, 5]}
    assert row["strategies"].startswith("training forward: bf16/fp32 matmuls")
    assert row["stage"] == "B" and row["micro_steps"] == 1 and row["step_ms"]["n"] == 2
    assert row["phases_ms"]["optimizer_even_ms"]["n"] == row["phases_ms"]["optimizer_odd_ms"]["n"] == 1
    assert row["host_issue_ms"]["median_ms"] > 0 and row["host_syncs_per_step"] is None  # CPU
    assert row["compiles"].get("timed", 0) == 0
    # the profiled window: no device on the CPU, so no busy fraction; its trace kept whole
    assert row["gpu_busy"] is None and row["kernels_per_step"] == 0
    trace = tmp_path / "traces" / "trace_B_off.json.gz"
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert [p.name for p in trace.parent.iterdir()] == [trace.name]  # no temp file left


def test_step_bench_profile_window(tmp_path, capsys):
    """--profile-steps N: the trainer profiles N steps after the timed ones (the stage is that much
    longer); 0 or more than the trainer's limit is a usage error naming the flag."""
    from bench import step as bench_step
    args = bench_step.parse(["--stage", "A", "--steps", "4", "--profile", "--profile-steps", "6",
                             "--out", str(tmp_path / "o.json")])
    cfg, _ = bench_step.stage_config(args, "on", tmp_path)
    assert cfg.train.profile_steps == (4, 10) and cfg.schedule.stages[0].num_steps == 10
    for bad in ("0", str(bench_step.MAX_PROFILE_STEPS + 1)):
        with pytest.raises(SystemExit) as e:
            bench_step.parse(["--profile-steps", bad, "--out", str(tmp_path / "o.json")])
        assert e.value.code == 2 and f"--profile-steps {bad}: needs 1 to" in capsys.readouterr().err


def test_flops_formula():
    c = GPTConfig()
    params = model_bench.matmul_params(c)
    assert params == {"qk_bank": 10 * 6 * 256 * 768, "vo_bank": 20 * 768 * 768,
                      "mlp_bank": 11 * 2 * 3072 * 768, "lm_head": 768 * 50304}
    assert model_bench._keys_attended([3], 2) == 1 + 2 + 2
    assert model_bench._keys_attended([2, 5], 8) == 3 + 15
    spec = common.key_specs(smoke=False)["C"]
    pieces = [512] * 96  # 49,152 tokens
    f = model_bench.flops(c, spec, pieces)
    assert f["dense_flops"] == 6 * sum(params.values()) * 49152
    # 8 short-window layers (640 > 512: the document length binds) + 2 long, x3 for fwd + bwd
    assert f["attention_flops"] == pytest.approx(10 * 3 * 4 * 49152 * 512 * 768)
    assert f["attention_exact_causal_flops"] < f["attention_flops"]


@pytest.mark.parametrize("name", ["A_half", "A", "B", "C", "D"])
def test_synthetic_batch_packing(name):
    spec = common.key_specs(smoke=False)[name]
    batch, pieces = common.synthetic_batch(spec, torch.device("cpu"), seed=3)
    t, cu = spec.tokens, batch.cum_seqlens
    assert batch.inputs.shape == (t,) and batch.inputs.dtype == torch.int32
    assert batch.targets.dtype == torch.int64 and torch.equal(batch.inputs[1:].long(), batch.targets[:-1])
    assert cu.shape == (spec.cu_seqlens_rows,) and cu[0] == 0 and cu[-1] == t
    assert bool((cu[1:] >= cu[:-1]).all()) and sum(pieces) == t
    starts = cu[cu < t].long()
    assert bool((batch.inputs[starts] == common.BOS_ID).all())
    assert int(batch.inputs.max()) <= common.BOS_ID and max(pieces) <= spec.max_seq_len


def test_kernel_stats_rank_kernels_and_count_overlaps_once():
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "dur": 300.0},
              {"ph": "X", "cat": "kernel", "name": "quantise", "dur": 100.0},
              {"ph": "X", "cat": "kernel", "name": "quantise", "dur": 250.0},
              {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "dur": 1000.0},  # not a kernel
              {"ph": "X", "cat": "kernel", "name": "norm", "dur": 10.0}]
    assert profiling.top_kernels(events, num_steps=2, top=2) == [
        {"name": "quantise", "ms_per_step": 0.175, "calls_per_step": 1.0},
        {"name": "gemm", "ms_per_step": 0.15, "calls_per_step": 0.5}]
    timed = [{"ph": "X", "cat": "kernel", "name": "a", "ts": 0.0, "dur": 100.0},
             {"ph": "X", "cat": "kernel", "name": "b", "ts": 50.0, "dur": 100.0},  # overlaps a
             {"ph": "X", "cat": "gpu_memcpy", "name": "h2d", "ts": 300.0, "dur": 50.0}]
    stats = profiling.kernel_stats(timed, num_steps=1)
    # busy: [0, 150) and [300, 350) = 200 us of a 350 us span (an idle gap of 150 us)
    assert stats == {"kernel_ms": 0.2, "device_busy_ms": 0.2, "device_span_ms": 0.35,
                     "busy_fraction": pytest.approx(200 / 350), "kernels_per_step": 2.0}
    assert profiling.kernel_stats([], num_steps=1)["busy_fraction"] is None


def test_corpus_flops_compares_real_and_synthetic_batches(tmp_path):
    """bench/corpus_flops.py on a shard of documents of 300..420 tokens: shorter than the bench's
    lognormal ones (mean ~470 at key A), so the ratio is below 1; long enough that key A's 16,384
    tokens fit its 63 documents, as the trainer's packing (data.TrainStream) requires."""
    from bench import corpus_flops
    from tests.conftest import make_docs
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    docs = make_docs(np.random.default_rng(0), 400, 300, 420)
    write_shard(shard_dir / "t_train_000000.bin", np.concatenate(docs))
    out = tmp_path / "cf.json"
    assert corpus_flops.main(["--data-dir", str(shard_dir), "--keys", "A", "--batches", "2",
                              "--out", str(out)]) == 0
    row = json.loads(out.read_text())["keys"]["A"]
    assert row["mean_piece_real"] < row["mean_piece_synthetic"]
    assert 0.9 < row["flops_real_over_synthetic"]["median"] < 1.0
    spec = common.key_specs(False)["A"]
    stream = TrainStream(list_shards(shard_dir, "train"), seed=0)
    pieces = corpus_flops.real_pieces(stream, spec)
    assert sum(pieces) == spec.tokens + 1 and max(pieces) <= spec.max_seq_len
