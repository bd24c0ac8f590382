"""The result builders bench/vs_record.py, bench/host_bound.py and bench/loss_parity.py on fixture
inputs: every output field from the source field its module docstring names, null where a side
has no such field, and exit code 2 with the file named for a missing input or one of the wrong
kind.

Fixtures: tests/fixtures/record_timing_h200.json (the record harness's timing.json of
shared/anchor_modded/results/h200_2026-12-01/timing_fresh_process.json, trimmed; stage 0 given
the `profiled` block of RESULTS.md's kernel-time run, stage 2 none), tests/fixtures/record_loss/
(that folder's loss.jsonl and loss.json, trimmed), tests/fixtures/step_smoke_A_off.json (a real
`bench/step.py --smoke` output from this CPU machine). Our GPU-side bench/step.py results and run
dirs are built in tmp_path with round numbers, so every mapped value is known exactly.
Hardware: CPU, ~5 s. Run: `.venv/bin/python -m pytest tests/test_bench_results.py -q`.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import host_bound, loss_parity, step_variants, vs_record
from track_1_short.data import BOS_ID, write_shard

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
RECORD_TIMING = FIXTURES / "record_timing_h200.json"
RECORD_LOSS = FIXTURES / "record_loss"
SMOKE_STEP = FIXTURES / "step_smoke_A_off.json"


def _stats(median: float, p10: float | None = None, p90: float | None = None) -> dict:
    return {"median_ms": median, "p10_ms": p10 if p10 is not None else median,
            "p90_ms": p90 if p90 is not None else median, "mean_ms": median, "n": 19}


def _row(graphs: str, stage: str, tokens: int, micro: int, *, step=(284.0, 280.0, 290.0),
         micro_steps_ms=260.0, replay=30.0, kernel=270.4, busy=272.4, host=100.0, syncs=0.0,
         mfu=0.4) -> dict:
    """A bench/step.py variant row (the keys run_variant writes)."""
    row = {"graphs": graphs, "stage": stage, "micro_steps": micro, "tokens_per_micro_step": tokens,
           "step_ms": _stats(*step),
           "phases_ms": {"micro_steps_ms": _stats(micro_steps_ms), "micro_step_ms": micro_steps_ms / micro,
                         "optimizer_even_ms": _stats(12.0), "optimizer_odd_ms": _stats(16.0),
                         "ngram_update_ms": _stats(13.7)},
           "host_issue_ms": _stats(host), "host_syncs_per_step": syncs,
           "capture_report": ([{"key": {"tokens": tokens, "cu_seqlens_rows": 32}, "replay_ms": replay}]
                              if replay is not None else []),
           "mfu_micro_step": mfu}
    if kernel is not None:
        row.update(kernel_ms_per_step=kernel, device_busy_ms_per_step=busy,
                   gpu_busy=busy / step[0])
    return row


def _step_json(path: Path, stage: str, variants: dict, errors: dict | None = None) -> Path:
    data = {"command": f"PYTHONPATH=. python bench/step.py --stage {stage}", "machine": {"gpu": "NVIDIA H200"},
            "stage": stage, "steps": 20, "micro_steps": 8, "variants": variants, "errors": errors or {},
            "complete": not errors}
    path.write_text(json.dumps(data))
    return path


def _ours_vs_record(tmp_path: Path, graphs: str = "on", **row) -> list[Path]:
    return [_step_json(tmp_path / "step_A.json", "A", {graphs: _row(graphs, "A", 16384, 8, **row)}),
            _step_json(tmp_path / "step_C.json", "C", {graphs: _row(graphs, "C", 49152, 8, **row)})]


def _vs_record(tmp_path: Path, record: Path, ours: list[Path], *extra: str) -> int:
    argv = ["--record", str(record), *[a for p in ours for a in ("--ours", str(p))],
            "--date", "2026-12-01", "--out-dir", str(tmp_path / "out"), *extra]
    return vs_record.run_main("vs_record", vs_record.main, argv)


# ---------------------------------------------------------------- vs_record

def test_vs_record_maps_each_field_from_its_source(tmp_path):
    assert _vs_record(tmp_path, RECORD_TIMING, _ours_vs_record(tmp_path), "--script", "bash x.sh") == 0
    out = json.loads((tmp_path / "out" / "vs_record_h200_2026-12-01.json").read_text())
    record_in = json.loads(RECORD_TIMING.read_text())
    assert out["command"]["script"] == "bash x.sh"
    assert out["command"]["record"] == record_in["run"]["command"]
    assert out["command"]["ours"]["C"] == "PYTHONPATH=. python bench/step.py --stage C"
    assert out["machine"]["name"] == "h200"
    assert out["machine"]["record"]["host_probe"] == record_in["machine"]["host_probe"]
    assert set(out["stages"]) == {"A", "C"}
    a = out["stages"]["A"]
    assert a["ours"] == {"step_ms": {"median": 284.0, "p10": 280.0, "p90": 290.0},
                         "kernel_ms_per_step": 270.4,
                         "phases_ms": {"fwd_bwd_per_micro_step": 30.0, "optimizer_even": 12.0,
                                       "optimizer_odd": 16.0, "ngram_event": 13.7,
                                       "extras": pytest.approx(260.0 - 8 * 30.0)},
                         "mfu_fwd_bwd": pytest.approx(0.4 * 32.5 / 30.0)}
    steady = record_in["stages"]["0"]["steady"]
    assert a["record"] == {
        "step_ms": {"median": steady["step_ms"]["median"], "p10": steady["step_ms"]["p10"],
                    "p90": steady["step_ms"]["p90"]},
        "kernel_ms_per_step": 214.1,
        "phases_ms": {"fwd_bwd_per_micro_step": steady["fwd_bwd_ms"]["median"],
                      "optimizer_even": steady["opt_even_ms"]["median"],
                      "optimizer_odd": steady["opt_odd_ms"]["median"], "ngram_event": None,
                      "extras": pytest.approx(8 * steady["data_ms"]["median"] + steady["quant_ms"]["median"])}}
    assert a["ratio"] == {"step_ms_median": pytest.approx(284.0 / steady["step_ms"]["median"]),
                          "kernel_ms_per_step": pytest.approx(270.4 / 214.1)}
    # the record's stage 2 has no profiled block: its kernel time and that ratio are null
    c = out["stages"]["C"]
    assert c["record"]["kernel_ms_per_step"] is None and c["ratio"]["kernel_ms_per_step"] is None
    assert c["record"]["step_ms"]["median"] == record_in["stages"]["2"]["steady"]["step_ms"]["median"]


def test_vs_record_writes_null_where_our_side_has_no_such_field(tmp_path):
    """Graphs off: no replay (no fwd+bwd time, extras or fwd+bwd MFU); no profile: no kernel time."""
    ours = _ours_vs_record(tmp_path, graphs="off", replay=None, kernel=None)
    assert _vs_record(tmp_path, RECORD_TIMING, ours, "--graphs", "off", "--stages", "A") == 0
    # one stage: its name says which (a device call holds one stage of both trainers)
    assert [p.name for p in (tmp_path / "out").glob("vs_record_*.json")] == ["vs_record_h200_2026-12-01_A.json"]
    out = json.loads((tmp_path / "out" / "vs_record_h200_2026-12-01_A.json").read_text())
    assert set(out["stages"]) == {"A"}
    a = out["stages"]["A"]
    assert a["ours"]["phases_ms"]["fwd_bwd_per_micro_step"] is None
    assert a["ours"]["phases_ms"]["extras"] is None and a["ours"]["mfu_fwd_bwd"] is None
    assert a["ours"]["kernel_ms_per_step"] is None and a["ratio"]["kernel_ms_per_step"] is None
    assert a["ratio"]["step_ms_median"] is not None


# ---------------------------------------------------------------- step_variants

def _step_variants(tmp_path: Path, *paths: Path, extra: tuple[str, ...] = ()) -> int:
    argv = [*map(str, paths), "--date", "2026-12-01", "--out-dir", str(tmp_path / "out"), *extra]
    return step_variants.run_main("step_variants", step_variants.main, argv)


def test_step_variants_divides_each_variant_by_the_baseline_and_keeps_failures(tmp_path):
    bf16 = _step_json(tmp_path / "step_C_bf16.json", "C", {"on": _row("on", "C", 49152, 8, step=(720.0, 715.0, 730.0), kernel=716.0)})
    fa4_row = _row("on", "C", 49152, 8, step=(680.0, 675.0, 685.0), kernel=674.0)
    fa4_row["strategies"] = "training forward: fp8 (lm_head), otherwise bf16/fp32 matmuls"
    fa4 = _step_json(tmp_path / "step_C_fa4.json", "C", {"on": fa4_row})
    quack = _step_json(tmp_path / "step_C_quack_mlp.json", "C", {},
                       errors={"on": {"error": "TypeError: epilogue fn depends on <ContextVar>"}})
    assert _step_variants(tmp_path, bf16, fa4, quack, extra=("--script", "bash fp8_step.sh")) == 0
    out = json.loads((tmp_path / "out" / "step_variants_h200_2026-12-01_C.json").read_text())
    assert out["stage"] == "C" and out["baseline"] == "bf16"
    assert out["command"]["script"] == "bash fp8_step.sh"
    assert set(out["command"]["variants"]) == {"bf16", "fa4", "quack_mlp"}
    v = out["variants"]
    assert v["fa4"]["ratio_to_baseline"] == {"step_ms_median": pytest.approx(680.0 / 720.0),
                                             "kernel_ms_per_step": pytest.approx(674.0 / 716.0)}
    assert v["bf16"]["ratio_to_baseline"]["step_ms_median"] == 1.0
    assert v["fa4"]["step_ms"] == {"median": 680.0, "p10": 675.0, "p90": 685.0}
    assert v["fa4"]["strategies"] == fa4_row["strategies"] and v["bf16"]["strategies"] is None
    assert "it failed: TypeError: epilogue fn depends on <ContextVar>" in v["quack_mlp"]["error"]
    assert "ratio_to_baseline" not in v["quack_mlp"]


@pytest.mark.parametrize("case,expected", [
    ("bad name", "name it step_<STAGE>_<VARIANT>.json"),
    ("no baseline", "--baseline bf16: no step_*_bf16.json"),
    ("two stages", "the files hold stages ['A', 'C']"),
    ("baseline failed", "--baseline bf16: "),
])
def test_step_variants_refuses_bad_inputs(tmp_path, capsys, case, expected):
    ok = {"on": _row("on", "C", 49152, 8)}
    files = {
        "bad name": [_step_json(tmp_path / "fa4.json", "C", ok)],
        "no baseline": [_step_json(tmp_path / "step_C_fa4.json", "C", ok)],
        "two stages": [_step_json(tmp_path / "step_C_bf16.json", "C", ok),
                       _step_json(tmp_path / "step_A_fa4.json", "A", {"on": _row("on", "A", 16384, 8)})],
        "baseline failed": [_step_json(tmp_path / "step_C_bf16.json", "C", {}, errors={"on": {"error": "cut"}})],
    }[case]
    assert _step_variants(tmp_path, *files) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case,expected", [
    ("record missing", "missing.json does not exist (the record harness's timing.json expected"),
    ("record not JSON", "bad.json: not JSON"),
    ("record is a step result", "not the record harness's timing.json (mode=None"),
    ("ours is a timing.json", "record_timing_h200.json: not a bench/step.py result"),
    ("ours lacks stage C", "no bench/step.py result for stage C"),
    ("ours lacks graphs on", "no graphs=on variant (it failed: RuntimeError: capture failed)"),
    ("ours is the CPU smoke run", "512 tokens x 1 micro-steps"),
])
def test_vs_record_refuses_bad_inputs_naming_the_file(tmp_path, capsys, case, expected):
    ours = _ours_vs_record(tmp_path)
    record = RECORD_TIMING
    if case == "record missing":
        record = tmp_path / "missing.json"
    elif case == "record not JSON":
        record = _write_text(tmp_path / "bad.json", "{not json")
    elif case == "record is a step result":
        record = ours[0]
    elif case == "ours is a timing.json":
        ours = [RECORD_TIMING, ours[1]]
    elif case == "ours lacks stage C":
        ours = ours[:1]
    elif case == "ours lacks graphs on":
        ours[1] = _step_json(tmp_path / "step_C.json", "C", {"off": _row("off", "C", 49152, 8)},
                             errors={"on": {"error": "RuntimeError: capture failed"}})
    elif case == "ours is the CPU smoke run":
        ours = [SMOKE_STEP, ours[1]]
        assert _vs_record(tmp_path, record, ours, "--graphs", "off") == 2
        assert expected in capsys.readouterr().err
        return
    assert _vs_record(tmp_path, record, ours) == 2
    err = capsys.readouterr().err
    assert err.startswith("vs_record: error: ") and expected in err
    assert not (tmp_path / "out").exists()


def test_vs_record_cli_exits_2_naming_the_missing_file(tmp_path):
    proc = subprocess.run([sys.executable, "bench/vs_record.py", "--record", str(tmp_path / "nope.json"),
                           "--ours", str(SMOKE_STEP), "--out-dir", str(tmp_path)],
                          cwd=REPO, env={"PYTHONPATH": "."}, capture_output=True, text=True)
    assert proc.returncode == 2 and "nope.json does not exist" in proc.stderr


# ---------------------------------------------------------------- host_bound

def _host_bound(tmp_path: Path, paths: list[Path], *extra: str) -> int:
    argv = [*[a for p in paths for a in ("--step", str(p))], "--date", "2026-12-01",
            "--out-dir", str(tmp_path / "out"), *extra]
    return host_bound.run_main("host_bound", host_bound.main, argv)


def _host_bound_inputs(tmp_path: Path, micro: int = 1) -> list[Path]:
    def variants(stage, tokens, on_step, off_step):
        on = _row("on", stage, tokens, micro, step=on_step, host=20.0, syncs=0.0)
        off = _row("off", stage, tokens, micro, step=off_step, host=40.0, syncs=2.0, replay=None, kernel=None)
        # the two parities apart (odd steps add Adam): the mean lies between them, off the median
        for row, (even, odd) in ((on, (on_step[0] - 1.0, on_step[0] + 3.0)), (off, (off_step[0] - 1.0, off_step[0] + 4.0))):
            row["step_ms"]["mean_ms"] = (even + odd) / 2
            row["step_even_ms"], row["step_odd_ms"] = _stats(even), _stats(odd)
        return {"on": on, "off": off}
    return [_step_json(tmp_path / "hb_A.json", "A", variants("A", 16384, (35.0, 34.0, 36.0), (50.0, 48.0, 52.0))),
            _step_json(tmp_path / "hb_C.json", "C", variants("C", 49152, (105.0, 104.0, 106.0), (106.0, 105.0, 108.0)))]


def test_host_bound_maps_each_field_and_the_on_off_ratio(tmp_path):
    paths = _host_bound_inputs(tmp_path)
    data = json.loads(paths[1].read_text())  # stage C from another call: its own machine record
    data["machine"] = {"gpu": "NVIDIA H200", "date": "2026-12-01T23:53:00+0000"}
    paths[1].write_text(json.dumps(data))
    assert _host_bound(tmp_path, paths) == 0
    out = json.loads((tmp_path / "out" / "host_bound_h200_2026-12-01.json").read_text())
    assert out["command"]["ours"]["A"].endswith("--stage A") and out["machine"]["name"] == "h200"
    assert out["machine"]["ours"] == {"gpu": "NVIDIA H200"}
    assert out["machine"]["by_stage"] == {"A": {"gpu": "NVIDIA H200"}, "C": data["machine"]}
    a = out["stages"]["A"]
    assert a["graphs_on"] == {"step_ms": {"median": 35.0, "p10": 34.0, "p90": 36.0, "mean": 36.0},
                              "step_ms_by_parity": {"even": 34.0, "odd": 38.0}, "host_issue_ms": 20.0,
                              "gpu_busy": pytest.approx(272.4 / 35.0),
                              # the window's busy device ms per step over the timed mean step
                              "gpu_busy_timed": pytest.approx(272.4 / 36.0), "host_syncs_per_step": 0.0}
    # graphs off ran without the profiler here: no gpu_busy
    assert a["graphs_off"] == {"step_ms": {"median": 50.0, "p10": 48.0, "p90": 52.0, "mean": 51.5},
                               "step_ms_by_parity": {"even": 49.0, "odd": 54.0}, "host_issue_ms": 40.0,
                               "gpu_busy": None, "gpu_busy_timed": None, "host_syncs_per_step": 2.0}
    assert a["on_over_off"] == {"step_ms_median": pytest.approx(0.7), "step_ms_mean": pytest.approx(36.0 / 51.5),
                                "host_issue_ms": pytest.approx(0.5)}
    assert out["stages"]["C"]["on_over_off"]["step_ms_median"] == pytest.approx(105.0 / 106.0)


def test_host_bound_refuses_more_micro_steps_and_a_missing_variant(tmp_path, capsys):
    assert _host_bound(tmp_path, _host_bound_inputs(tmp_path, micro=8)) == 2
    assert "hb_A.json: graphs=on ran 8 micro-steps" in capsys.readouterr().err
    paths = _host_bound_inputs(tmp_path)
    data = json.loads(paths[1].read_text())
    del data["variants"]["off"]
    data["errors"] = {"off": {"error": "TimeoutError: cut"}}
    paths[1].write_text(json.dumps(data))
    assert _host_bound(tmp_path, paths) == 2
    assert "hb_C.json: no graphs=off variant (it failed: TimeoutError: cut)" in capsys.readouterr().err
    assert _host_bound(tmp_path, [paths[0], RECORD_TIMING]) == 2
    assert "record_timing_h200.json: not a bench/step.py result" in capsys.readouterr().err


# ---------------------------------------------------------------- loss_parity

def _corpus(root: Path, shards: list[int], doc_tokens: int = 100, val_tokens: int = 300) -> Path:
    """shards[i] documents of doc_tokens tokens each (BOS first) per train shard, one val shard."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i, num_docs in enumerate(shards):
        docs = rng.integers(0, 50000, (num_docs, doc_tokens))
        docs[:, 0] = BOS_ID
        write_shard(root / f"x_train_{i:06d}.bin", docs.reshape(-1))
    val = rng.integers(0, 50000, val_tokens)
    val[::50] = BOS_ID
    write_shard(root / "x_val_000000.bin", val)
    return root


def _steps(n: int, tokens: int = 127, max_seq_len: int = 64) -> list:
    return [loss_parity.StageShape("A", n, tokens, max_seq_len)] * n


def test_first_repeat_of_each_loader_and_the_token_count_bound(tmp_path):
    # one shard of 50 documents of 100 tokens; a micro-batch of 127 + 1 tokens takes 2 documents
    # (each cut at 64), 8 per step: 16 documents per step, so step 3 takes documents 48, 49 and
    # then the next epoch's; the tokens trained pass the corpus (5000) at step 4 (5 x 1016)
    one = _corpus(tmp_path / "one", [50])
    train = sorted(one.glob("*_train_*.bin"))
    assert loss_parity.ours_first_repeat(train, seed=0, shuffle=True, steps=_steps(10), slices_per_step=8) == 3
    assert loss_parity.record_first_repeat(train, _steps(10)) == 3
    assert loss_parity.token_count_bound(_steps(10), 8, 5000) == 4
    # 16 shards of 3 documents: upstream's loader serves one micro-batch per shard and drops the
    # third document (a micro-batch that hits a shard's tail is redone on the next shard), so
    # it runs out at step 2; ours walks on across shards and uses all 48 documents in 3 steps
    many = _corpus(tmp_path / "many", [3] * 16)
    train = sorted(many.glob("*_train_*.bin"))
    assert loss_parity.record_first_repeat(train, _steps(10)) == 2
    assert loss_parity.ours_first_repeat(train, seed=0, shuffle=True, steps=_steps(10), slices_per_step=8) == 3
    assert loss_parity.ours_first_repeat(train, seed=0, shuffle=True, steps=_steps(3), slices_per_step=8) is None


def test_file_order_gives_the_records_token_stream_and_a_shard_tail_breaks_it(tmp_path):
    """Our TrainStream in file order against upstream's loader, token for token: documents of
    1-150 tokens (some cut at max_seq_len 64, some shorter than one micro-batch's remainder) in one
    shard give the same micro-batches at every step until the record's loader runs out."""
    root = tmp_path / "varied"
    root.mkdir()
    rng = np.random.default_rng(1)
    docs = [np.concatenate([[BOS_ID], rng.integers(0, 50000, n - 1)]) for n in rng.integers(1, 150, 400)]
    write_shard(root / "x_train_000000.bin", np.concatenate(docs))
    train = [root / "x_train_000000.bin"]
    steps = _steps(6) + [loss_parity.StageShape("B", 20, 255, 128)] * 20
    assert loss_parity.record_first_repeat(train, steps) is not None  # the walk reaches the end
    assert loss_parity.first_stream_difference(train, False, steps, 8) is None
    assert loss_parity.first_stream_difference(train, True, steps, 8) == 0  # seeded order
    assert loss_parity.first_stream_difference(train, False, steps, 4) == 0  # other batch
    # 16 shards of 3 documents: upstream redoes a micro-batch that hits a shard's tail on the next
    # shard (dropping the tail), ours walks on across shards: different tokens from step 0
    many = _corpus(tmp_path / "many", [3] * 16)
    assert loss_parity.first_stream_difference(sorted(many.glob("*_train_*.bin")), False, _steps(3), 8) == 0


def _our_run(run_dir: Path, data_dir: Path, val: dict[int, float], stages=((3, 127), (3, 127)),
             summary: bool = True, shuffle: bool = True, train: dict[int, float] | None = None,
             train_cfg: dict | None = None) -> Path:
    run_dir.mkdir(parents=True)
    cfg = {"preset": "test", "data": {"data_dir": str(data_dir), "seed": 0, "shuffle": shuffle, "slices_per_step": 8,
                                      "micro_steps": None, "val_tokens": 10_485_760, "val_tokens_per_batch": 64},
           "schedule": {"stages": [{"name": n, "num_steps": steps, "tokens_per_rank": t, "max_seq_len": 64}
                                   for n, (steps, t) in zip("AB", stages)]},
           "train": {"run_id": run_dir.name, **(train_cfg or {})}}
    (run_dir / "config.json").write_text(json.dumps(cfg))
    lines = [{"kind": "train", "step": s, "loss": v, "train_time_s": 0.1, "epoch": 0}
             for s, v in (train or {0: 11.0}).items()]
    lines += [{"kind": "val", "step": s, "val_loss": v, "train_time_s": 1.0 * s} for s, v in val.items()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({"world_size": 1}))
    return run_dir


def _record_run(out_dir: Path, data_dir: Path, val: dict[int, float], boundaries=((0, 3), (3, 6)),
                train_tokens: int = 5000, val_tokens: int = 256, train: dict[int, float] | None = None,
                settings: dict | None = None) -> Path:
    """The harness's loss.jsonl / loss.json; train: 0-based step -> train objective (written as
    the harness's 1-based `step`); settings: its run.config (ITERS, OUT_DIR, ...)."""
    out_dir.mkdir(parents=True)
    lines = [{"kind": "warmup", "step": 0, "stage": 0, "total_s": 100.0}]
    lines += [{"kind": "train", "step": s + 1, "train_loss": v} for s, v in (train or {}).items()]
    lines += [{"kind": "val", "step": s, "val_loss": v, "train_time_ms": 10.0 * s, "ws": [1, 3]}
              for s, v in val.items()]
    (out_dir / "loss.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (out_dir / "loss.json").write_text(json.dumps({
        "mode": "loss", "run": {"command": "run.sh loss ITERS=...", "config": settings or {}}, "status": "complete",
        "schedule": {"boundaries": [list(b) for b in boundaries]},
        "val": {"files": [str(data_dir / "x_val_000000.bin")], "tokens": val_tokens, "tokens_per_forward": 64,
                "backend": "aot_eager"},
        "train_data": {"files": [], "tokens": train_tokens}}))
    return out_dir


def _loss_parity(tmp_path: Path, ours: Path, record: Path, data: Path) -> int:
    return loss_parity.run_main("loss_parity", loss_parity.main, [
        "build", "--ours", str(ours), "--record", str(record), "--data-dir", str(data),
        "--date", "2026-12-01", "--out-dir", str(tmp_path / "out")])


def test_loss_parity_pairs_common_steps_and_finds_the_gap_before_the_first_repeat(tmp_path):
    data = _corpus(tmp_path / "tiny", [50])
    ours = _our_run(tmp_path / "ours", data, {0: 10.0, 2: 8.0, 4: 6.0, 6: 5.0})
    record = _record_run(tmp_path / "anchor", data, {0: 10.1, 2: 7.5, 4: 6.2, 5: 6.0, 6: 5.5})
    assert _loss_parity(tmp_path, ours, record, data) == 0
    out = json.loads((tmp_path / "out" / "loss_parity_tiny_2026-12-01.json").read_text())
    assert out["corpus"] == "tiny" and out["corpus_tokens"] == 5000
    assert out["val_tokens"] == 256 and out["val_tokens_per_forward"] == 64  # (300 - 1) // 64 batches
    assert out["record_val_backend"] == "aot_eager" and out["boundaries"] == [[0, 3], [3, 6]]
    assert out["repeats"] == {"ours": 3, "record": 3, "token_count_bound": 4} and out["repeats_at_step"] == 3
    assert out["val"] == [{"step": 0, "ours": 10.0, "record": 10.1}, {"step": 2, "ours": 8.0, "record": 7.5},
                          {"step": 4, "ours": 6.0, "record": 6.2}, {"step": 6, "ours": 5.0, "record": 5.5}]
    # steps 0 and 2 come before the repeat at 3; the larger gap there is +0.5 at step 2 (step 6's
    # -0.5 comes after it)
    assert out["max_gap_before_repeat"] == pytest.approx(0.5) and out["max_gap_step"] == 2
    assert out["max_excess_before_repeat"] == {"gap": pytest.approx(0.5), "step": 2}
    assert out["train_gap"] is None  # a shuffled order: no two steps hold the same tokens
    assert out["stage_start_validation"] == "trained"  # a run dir from before the setting
    assert out["complete"] == {"ours": True, "record": True}
    assert out["command"]["record"] == "run.sh loss ITERS=..."


def test_train_gap_per_stage_on_the_same_tokens():
    """ours - record train objective per stage, only over steps both logged before the first
    repeat or stream difference (whichever comes first); none when the streams differ at once;
    the excess criterion is signed (a larger negative gap is not the worst excess)."""
    ours = {s: 5.0 for s in range(10)}
    record = {s: 5.0 - (0.1 if s < 4 else -0.2 if s == 6 else 0.0) for s in range(10) if s != 5}
    gaps = loss_parity.train_gap(ours, record, [[0, 4], [4, 10]], ["A", "B"], until=8)
    assert gaps == [{"stage": "A", "steps": [0, 4], "mean": pytest.approx(0.1), "sd": pytest.approx(0.0),
                     "max": pytest.approx(0.1), "max_step": 0},
                    {"stage": "B", "steps": [4, 8], "mean": pytest.approx(-0.2 / 3), "sd": pytest.approx(0.0943, abs=1e-4),
                     "max": pytest.approx(0.0), "max_step": 4}]
    assert loss_parity.train_gap(ours, record, [[0, 4], [4, 10]], ["A", "B"], until=0) is None
    assert [g["stage"] for g in loss_parity.train_gap(ours, record, [[0, 4], [4, 10]], ["A", "B"], until=3)] == ["A"]


def test_transition_jump_recovery_and_the_record_step_convention(tmp_path):
    """The train objective around a stage boundary: the mean of the 5 steps before, the largest of
    the 5 after minus it, the first step back at or below it; the harness's `step: k` is step k-1;
    a window with a step missing, or past the first repeat, gives nothing."""
    ours = {s: 4.0 for s in range(55, 60)} | {60: 5.5, 61: 5.0, 62: 4.5, 63: 4.2, 64: 3.9, 65: 3.8}
    t = loss_parity.transition(ours, 60)
    assert t == {"before": 4.0, "after": [5.5, 5.0, 4.5, 4.2, 3.9], "jump": pytest.approx(1.5),
                 "recovered_at": 64}
    assert loss_parity.transition({s: v for s, v in ours.items() if s != 57}, 60) is None
    assert loss_parity.transition({s: 1.0 for s in range(55, 60)} | {s: 2.0 for s in range(60, 65)},
                                  60)["recovered_at"] is None
    path = tmp_path / "loss.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"kind": "warmup", "step": 0}, {"kind": "train", "step": 60, "train_loss": 4.0},
        {"kind": "val", "step": 60, "val_loss": 5.0}, {"kind": "train", "step": 61, "train_loss": 4.5})))
    assert loss_parity.record_train_losses(path) == {59: 4.0, 60: 4.5}
    bounds = [[0, 60], [60, 120], [120, 180]]
    both = loss_parity.transitions(ours, ours, bounds, repeat_at=103)
    assert [b["step"] for b in both] == [60] and both[0]["ours"] == both[0]["record"] == t
    assert loss_parity.transitions(ours, ours, bounds, repeat_at=62) == []


def test_loss_parity_reads_a_renamed_copy_of_the_record_curve(tmp_path):
    """NAME.jsonl reads NAME.json beside it (a record curve committed under docs/results), and
    gives the same result as the harness's own loss.jsonl / loss.json."""
    data = _corpus(tmp_path / "tiny", [50])
    ours = _our_run(tmp_path / "ours", data, {0: 10.0, 2: 8.0})
    record = _record_run(tmp_path / "anchor", data, {0: 10.1, 2: 7.5})
    kept = tmp_path / "kept"
    kept.mkdir()
    shutil.copy(record / "loss.jsonl", kept / "record_loss.jsonl")
    shutil.copy(record / "loss.json", kept / "record_loss.json")
    out = tmp_path / "out" / "loss_parity_tiny_2026-12-01.json"
    assert _loss_parity(tmp_path, ours, record, data) == 0
    first = json.loads(out.read_text())
    assert _loss_parity(tmp_path, ours, kept / "record_loss.jsonl", data) == 0
    second = json.loads(out.read_text())
    assert {k: v for k, v in first.items() if k != "command"} == \
        {k: v for k, v in second.items() if k != "command"}


def test_loss_parity_refuses_runs_that_are_not_comparable(tmp_path, capsys):
    data = _corpus(tmp_path / "tiny", [50])
    ours = _our_run(tmp_path / "ours", data, {0: 10.0})
    # the committed record run trained on the 3.89M-token embedded corpus, not this one
    assert _loss_parity(tmp_path, ours, RECORD_LOSS, data) == 2
    err = capsys.readouterr().err
    assert "not the same train corpus (tokens): ours 5000" in err and "3887299" in err
    other = _record_run(tmp_path / "other", data, {0: 10.1}, boundaries=((0, 2), (2, 6)))
    assert _loss_parity(tmp_path, ours, other, data) == 2
    assert "not the same stage boundaries" in capsys.readouterr().err
    fewer = _record_run(tmp_path / "fewer", data, {0: 10.1}, val_tokens=192)
    assert _loss_parity(tmp_path, ours, fewer, data) == 2
    assert "not the same validation token count: ours 256" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_loss_parity_names_missing_or_wrong_inputs(tmp_path, capsys):
    data = _corpus(tmp_path / "tiny", [50])
    record = _record_run(tmp_path / "anchor", data, {0: 10.1})
    assert _loss_parity(tmp_path, tmp_path / "no_run", record, data) == 2
    assert "no_run/config.json does not exist" in capsys.readouterr().err
    ours = _our_run(tmp_path / "ours", data, {0: 10.0})
    assert _loss_parity(tmp_path, ours, ours / "metrics.jsonl", data) == 2
    assert "is a track_1_short metrics.jsonl, not the record's loss.jsonl" in capsys.readouterr().err
    assert _loss_parity(tmp_path, ours, tmp_path / "nowhere", data) == 2
    assert "nowhere does not exist: pass the loss.jsonl" in capsys.readouterr().err
    (record / "loss.json").unlink()
    assert _loss_parity(tmp_path, ours, record, data) == 2
    assert "anchor/loss.json does not exist" in capsys.readouterr().err
    assert _loss_parity(tmp_path, ours, RECORD_LOSS, tmp_path / "no_data") == 2
    assert "--data-dir: data dir" in capsys.readouterr().err


def _pool(tmp_path: Path, ours: list[Path], records: list[Path], data: Path) -> int:
    return loss_parity.run_main("loss_parity", loss_parity.main, [
        "pool", *[a for o in ours for a in ("--ours", str(o))], *[a for r in records for a in ("--record", str(r))],
        "--data-dir", str(data), "--variant", "v", "--date", "2026-12-02", "--out-dir", str(tmp_path / "out")])


def test_pool_compares_the_mean_curves_and_measures_each_sides_run_to_run_spread(tmp_path):
    """Two runs a side in file order (the same tokens until the repeat at step 3): the gap of the
    means, each side's pooled run-to-run sd over the points before the repeat, the gap's standard
    error, the train objective's mean-curve gap and largest spread; runs that differ only in their
    name and a diagnostic pool."""
    data = _corpus(tmp_path / "tiny", [50])
    ours = [_our_run(tmp_path / "o1", data, {0: 10.0, 2: 8.0, 4: 6.0}, shuffle=False,
                     train={0: 11.0, 1: 10.0, 2: 9.0}),
            _our_run(tmp_path / "o2", data, {0: 10.2, 2: 8.2, 4: 6.4}, shuffle=False,
                     train={0: 11.2, 1: 10.0, 2: 9.4}, train_cfg={"update_norm_steps": [1, 2]})]
    records = [_record_run(tmp_path / f"r{i}", data, val, train={0: 11.0, 1: 10.1, 2: 9.1},
                           settings={"iters": 6, "out_dir": f"/out/{i}"})
               for i, val in enumerate(({0: 10.1, 2: 7.9, 4: 6.2}, {0: 10.1, 2: 8.1, 4: 6.0}))]
    assert _pool(tmp_path, ours, records, data) == 0
    out = json.loads((tmp_path / "out" / "loss_parity_tiny_v_pooled_2026-12-02.json").read_text())
    assert out["n"] == {"ours": 2, "record": 2} and out["variant"] == "v"
    assert out["repeats_at_step"] == 3 and out["streams_differ_at_step"] is None
    assert [(p["step"], p["ours"], p["record"]) for p in out["val"]] == [
        (0, pytest.approx(10.1), pytest.approx(10.1)), (2, pytest.approx(8.1), pytest.approx(8.0)),
        (4, pytest.approx(6.2), pytest.approx(6.1))]
    assert out["val"][1]["ours_runs"] == [8.0, 8.2] and out["val"][1]["record_runs"] == [7.9, 8.1]
    # each point's own standard error: step 0 only ours spreads (0.02 / 2), step 2 both sides
    assert [p["se"] for p in out["val"][:2]] == [pytest.approx(0.1), pytest.approx(0.02 ** 0.5)]
    # each run against its own side's other run, before the repeat (the first of equal excesses)
    assert out["self_excess_before_repeat"] == {
        "ours": [{"gap": pytest.approx(-0.2), "step": 0}, {"gap": pytest.approx(0.2), "step": 0}],
        "record": [{"gap": pytest.approx(0.0), "step": 0}, {"gap": pytest.approx(0.2), "step": 2}]}
    # steps 0 and 2 (before the repeat): ours deviates by 0.1 at both, the record at step 2 only
    sd = out["run_to_run_sd"]["val"]
    assert sd["ours"] == pytest.approx(0.02 ** 0.5) and sd["record"] == pytest.approx(0.1)
    assert out["gap_se"] == pytest.approx(0.015 ** 0.5)
    assert out["max_excess_before_repeat"] == {"gap": pytest.approx(0.1), "step": 2}
    assert out["over_margin_before_repeat"] == [2]  # step 4's +0.1 is after the repeat
    assert out["train_gap"] == [{"stage": "A", "steps": [0, 3], "mean": pytest.approx(0.1 / 3),
                                 "sd": pytest.approx(0.0943, abs=1e-4), "max": pytest.approx(0.1), "max_step": 0}]
    assert out["run_to_run_sd"]["train"]["record"] == [{"stage": "A", "steps": [0, 3], "sd": pytest.approx(0.0)}]
    assert out["run_to_run_sd"]["train"]["ours"][0]["sd"] == pytest.approx(((0.02 + 0.08) / 3) ** 0.5)
    assert out["train_spread"]["ours"] == {"step": 2, "spread": pytest.approx(0.4)}
    assert out["transitions"] == []  # the window after step 3 lies past the repeat
    assert out["runs"]["ours"] == [str(o) for o in ours]


def test_pool_of_one_run_a_side_has_no_spread_and_refuses_runs_of_two_configurations(tmp_path, capsys):
    data = _corpus(tmp_path / "tiny", [50])
    one = _our_run(tmp_path / "o1", data, {0: 10.0, 2: 8.0})
    record = _record_run(tmp_path / "r1", data, {0: 10.1, 2: 7.9})
    assert _pool(tmp_path, [one], [record], data) == 0
    out = json.loads((tmp_path / "out" / "loss_parity_tiny_v_pooled_2026-12-02.json").read_text())
    assert out["run_to_run_sd"]["val"] == {"ours": None, "record": None} and out["gap_se"] is None
    assert out["train_gap"] is None and out["train_spread"] == {"ours": None, "record": None}
    assert [p["se"] for p in out["val"]] == [None, None]
    assert out["self_excess_before_repeat"] == {"ours": None, "record": None}
    other_seed = _our_run(tmp_path / "o2", data, {0: 10.0, 2: 8.0}, train_cfg={"seed": 1})
    assert _pool(tmp_path, [one, other_seed], [record], data) == 2
    err = capsys.readouterr().err
    assert "our runs to pool differ in train.seed: None" in err and "o2/config.json" in err
    r2 = _record_run(tmp_path / "r2", data, {0: 10.1, 2: 7.9}, settings={"iters": 9})
    r3 = _record_run(tmp_path / "r3", data, {0: 10.1, 2: 7.9}, settings={"iters": 6})
    assert _pool(tmp_path, [one], [r2, r3], data) == 2
    assert "the record's runs to pool differ in config.iters: 9" in capsys.readouterr().err
    assert _pool(tmp_path, [one], [tmp_path / "nowhere"], data) == 2  # each run checked as build does
    assert "nowhere does not exist" in capsys.readouterr().err


def test_pooled_transition_jumps_average_the_runs_that_measured_one():
    assert loss_parity.mean_jump([-0.1, None, 0.3]) == pytest.approx(0.1)
    assert loss_parity.mean_jump([None, None]) is None


def test_anchor_args_reproduce_a_preset_schedule_and_our_validation_tokens(tmp_path, capsys):
    data = _corpus(tmp_path / "d", [2], val_tokens=200_851)  # embedded-large's validation size
    assert loss_parity.main(["anchor-args", "--preset", "small-gpu", "--data-dir", str(data),
                             "--val-every", "10"]) == 0
    assert capsys.readouterr().out.split() == [
        "ITERS=180", "EXT_ITERS=8", "MUON_WARMUP=40", "MUON_COOLDOWN=10", "VAL_EVERY=10",
        "VAL_SEQ=32768", "VAL_TOKENS=196608"]
    assert loss_parity.anchor_args("speedrun", data, 250, None, None).startswith(
        "ITERS=1270 EXT_ITERS=15 MUON_WARMUP=300 MUON_COOLDOWN=50")
    assert loss_parity.run_main("loss_parity", loss_parity.main, [
        "anchor-args", "--preset", "cpu-tiny", "--data-dir", str(data), "--val-every", "10"]) == 2
    assert "the record splits ITERS into thirds" in capsys.readouterr().err
