"""Faults a user meets, injected on CPU: killed and interrupted checkpoint saves, signals, reused run
ids and bad inputs. Every case must end in an exact resume or in exit code 2 with a message naming
the file, flag or device (and, when found before training, no run dir left behind).

The kill -9 and signal scenarios run the real trainer in children forked from one helper process
(tests/fault_zygote.py, ~45 s and ~75 s on 2 busy cores); the rest are in-process and fast.
Run: `.venv/bin/python -m pytest tests/test_faults.py -q`.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from micro import nano_config

from track_1_short import config as config_mod
from track_1_short.data import BOS_ID, HEADER_BYTES, write_shard
from track_1_short.train import train
from track_1_short.trainer import checkpoint
from track_1_short.trainer.checkpoint import CheckpointError
from track_1_short.trainer.run_dir import RunDirError, claim_run_dir, truncate_metrics

TESTS = Path(__file__).resolve().parent


def _zygote(mode: str, shard_dir: Path, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.run([sys.executable, str(TESTS / "fault_zygote.py"), mode, str(shard_dir),
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_kill9_at_random_points_of_saves_never_leaves_a_broken_resumable_checkpoint(shard_dir, tmp_path):
    r = _zygote("kill", shard_dir, tmp_path)
    assert len(r["tries"]) == 20
    for t in r["tries"]:
        assert t["broken"] == [], f"try {t['try']}: a broken checkpoint under a resumable name"
        assert t["latest"] is not None, f"try {t['try']}: no complete checkpoint left"
        assert t["latest"] >= t["steps_trained"] - 2, f"try {t['try']}: lost more than the save in flight"
        assert t["equals_reference"], f"try {t['try']}: {t['latest_name']} differs from the " \
                                      f"uninterrupted run's checkpoint of that step"
    # the later claim recovers: only complete checkpoints under their final names remain
    assert all(name.endswith(tuple("0123456789")) for name in r["after_recovery"])
    assert r["resume_rc"] == 0 and r["resume_exact"], "resume from the newest checkpoint is exact"
    assert r["resumed_steps"] == list(range(r["resumed_from"], 12))


def test_sigterm_and_sigint_stop_at_a_checkpoint_and_resume_exactly(shard_dir, tmp_path):
    r = _zygote("signals", shard_dir, tmp_path)
    for name, code in (("sigterm_step", 143), ("sigterm_save", 143), ("sigint_step", 130)):
        case = r[name]
        assert case["rc"] == code, f"{name}: exit {case['rc']}"
        # the step running at the signal plus at most one more (checkpoints every 2 steps)
        assert case["trained"] - case["trained_at_signal"] <= 2, name
        stop = case["stop_record"]
        assert stop is not None and stop["step"] == case["trained"] + 1 == case["latest"], name
        assert case["left"] == [f"ckpt_step{case['latest']:06d}"], f"{name}: {case['left']}"
        assert case["resume_rc"] == 0 and case["resume_exact"], f"{name}: resume in place is exact"
    # mid-save: the save in flight completes and is the stop checkpoint (no second save)
    assert r["sigterm_save"]["trained"] == r["sigterm_save"]["trained_at_signal"]
    # Ctrl-C twice during a save: the second aborts at once; the checkpoint being written stays
    # .tmp, step 2's is intact
    double = r["double_sigint"]
    assert double["rc"] == 130 and double["stop_record"] is None
    assert double["latest"] == 2 and "ckpt_step000002" in double["left"]


@pytest.mark.slow
def test_ranks_agree_on_the_stop_step_and_a_dead_rank_is_named(shard_dir, tmp_path):
    """2 gloo ranks (forked): SIGTERM to rank 1 alone stops both after the same step with one
    checkpoint holding both ranks' shards, which resumes exactly; SIGKILL of rank 1 ends rank 0
    with exit 1 and an error naming rank 1 (~2 min on 2 busy cores: marked slow)."""
    r = _zygote("ranks", shard_dir, tmp_path)
    assert r["reference_rc"] == [0, 0]
    assert r["term_rc"] == [143, 143] and len(r["stop_steps"]) == 1
    assert r["latest"] == r["stop_steps"][0] and r["shards"] == ["__0_0.distcp", "__1_0.distcp"]
    assert r["resume_rc"] == [0, 0] and r["resume_exact"]
    assert r["dead_rc"][0] == 1 and "rank(s) [1] stopped answering" in r["dead_rank0_err"]


# ---------------------------------------------------------------- the swap, stage by stage

class _Killed(BaseException):
    pass


def _tiny_state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 8), value), "b": torch.arange(10.0) + value}}


def _save(run_dir: Path, steps: int, value: float) -> None:
    checkpoint.save_checkpoint(run_dir, steps, _tiny_state(value),
                               {"world_size": 1, "micro_steps": 1, "loader": None, "val_curve": [],
                                "train_time_s": 0.0}, is_main=True)


def _loaded_value(info) -> float:
    state = _tiny_state(-1.0)
    checkpoint.load_checkpoint(info, state)
    return float(state["model"]["w"][0, 0])


class _CrashAfter:
    """Makes the n-th file-system operation of the checkpoint module die (an rmtree half-way)."""

    def __init__(self, monkeypatch):
        self.n, self.ops = 0, []
        real_replace, real_rmtree = os.replace, shutil.rmtree

        def replace(*a, **k):
            self._tick("replace")
            return real_replace(*a, **k)

        def rmtree(path, *a, **k):
            if self._tick("rmtree", die=False):
                sorted(Path(path).iterdir())[0].unlink()  # part of the folder is gone
                raise _Killed
            return real_rmtree(path, *a, **k)

        monkeypatch.setattr(checkpoint.os, "replace", replace)
        monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)

    def _tick(self, name: str, die: bool = True) -> bool:
        self.ops.append(name)
        hit = len(self.ops) == self.n
        if hit and die:
            raise _Killed
        return hit

    def arm(self, n: int) -> None:
        self.n, self.ops = n, []


@pytest.mark.parametrize("same_step", [False, True])
def test_a_crash_at_every_stage_of_a_save_leaves_the_newest_complete_checkpoint(tmp_path, monkeypatch,
                                                                                same_step):
    """Death at each file-system operation of save_checkpoint (a new step; the swap over an
    existing step): every folder under a resumable name is complete, find_latest gives the newest
    complete save, and after the next claim's recovery it sits under its final name."""
    crash = _CrashAfter(monkeypatch)
    new_step = 4 if same_step else 6

    def prepared(name: str) -> Path:
        run_dir = tmp_path / name
        run_dir.mkdir()
        crash.arm(0)
        _save(run_dir, 2, 1.0)
        if same_step:
            _save(run_dir, 4, 2.0)
        return run_dir

    probe = prepared("probe")
    crash.arm(0)
    _save(probe, new_step, 3.0)
    num_ops = len(crash.ops)
    assert num_ops >= (5 if same_step else 2), crash.ops  # stale .tmp check, renames, deletes
    before = (4, 2.0) if same_step else (2, 1.0)
    for n in range(1, num_ops + 1):
        run_dir = prepared(f"crash{n}")
        crash.arm(n)
        with pytest.raises(_Killed):
            _save(run_dir, new_step, 3.0)
        crash.arm(0)
        for path in run_dir.glob("ckpt_step*"):
            if path.suffix in ("", ".old"):
                checkpoint.validate_checkpoint(path)  # raises if a resumable name is broken
        latest = checkpoint.find_latest(run_dir)
        found = (latest.steps_done, _loaded_value(latest))
        assert found in (before, (new_step, 3.0)), f"crash at op {n} ({crash.ops}): {found}"
        claim_run_dir(run_dir, resume_in_place=True).release()  # recovery under the lock
        names = sorted(p.name for p in run_dir.glob("ckpt_step*"))
        assert all("." not in name for name in names), f"crash at op {n}: {names} after recovery"
        latest = checkpoint.find_latest(run_dir)
        assert (latest.steps_done, _loaded_value(latest)) == found
        assert latest.path.name == f"ckpt_step{found[0]:06d}"


def test_validation_names_the_missing_or_truncated_file(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    _save(run_dir, 2, 1.0)
    ckpt = checkpoint.checkpoint_path(run_dir, 2)
    assert checkpoint.resolve_resume(run_dir).path == ckpt  # a run dir: its newest checkpoint
    data = next(ckpt.glob("*.distcp"))
    blob = data.read_bytes()
    data.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match=f"{data.name}.*truncated"):
        checkpoint.validate_checkpoint(ckpt)
    data.unlink()
    with pytest.raises(CheckpointError, match=f"data file {data.name} is missing"):
        checkpoint.validate_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="no complete checkpoint in this run dir"):
        checkpoint.resolve_resume(run_dir)
    (ckpt / "trainer.json").unlink()
    with pytest.raises(CheckpointError, match="no trainer.json"):
        checkpoint.validate_checkpoint(ckpt)


# ---------------------------------------------------------------- through train(): exit 2

def _nano(shard_dir, tmp_path, run_id, **kw):
    return nano_config(shard_dir, tmp_path, run_id, **kw)


@pytest.fixture(scope="module")
def finished_run(shard_dir, tmp_path_factory) -> Path:
    """A short nano run with a checkpoint at step 2 (read-only for the tests)."""
    runs = tmp_path_factory.mktemp("runs")
    assert train(_nano(shard_dir, runs, "done", max_steps=2)) == 0
    return runs / "done"


def test_damaged_checkpoint_resume_exits_2_naming_the_file(finished_run, shard_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(finished_run, bad)
    ckpt = bad / "ckpt_step000002"
    data = next(ckpt.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    assert train(_nano(shard_dir, tmp_path, "from-bad", resume=ckpt)) == 2
    err = capsys.readouterr().err
    assert f"{data.name}" in err and "truncated" in err and "Traceback" not in err
    assert not (tmp_path / "from-bad").exists(), "refused before training: no run dir"
    data.unlink()
    assert train(_nano(shard_dir, tmp_path, "from-bad", resume=ckpt)) == 2
    assert f"data file {data.name} is missing" in capsys.readouterr().err
    assert not (tmp_path / "from-bad").exists()


def test_existing_run_id_is_refused_and_overwrite_starts_clean(finished_run, shard_dir, tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(finished_run, runs / "done")
    before = sorted(p.name for p in (runs / "done").iterdir())
    assert train(_nano(shard_dir, runs, "done", max_steps=2)) == 2
    err = capsys.readouterr().err
    assert f"run dir {runs / 'done'} already exists" in err and "--overwrite" in err
    assert sorted(p.name for p in (runs / "done").iterdir()) == before, "left untouched"
    (runs / "done" / "stray.txt").write_text("from the old run")
    assert train(_nano(shard_dir, runs, "done", max_steps=2, overwrite=True)) == 0
    assert not (runs / "done" / "stray.txt").exists()
    records = [json.loads(line) for line in (runs / "done" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [0, 1], "one run's records only"


def test_a_second_live_process_on_a_run_dir_is_refused(tmp_path):
    first = claim_run_dir(tmp_path / "live")
    with pytest.raises(RunDirError, match=f"in use by another live process \\(pid {os.getpid()}"):
        claim_run_dir(tmp_path / "live", resume_in_place=True)
    first.release()
    claim_run_dir(tmp_path / "live", resume_in_place=True).release()  # free again


def test_resume_in_place_drops_records_after_the_checkpoint(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    records = [{"kind": "val", "step": 0}, *({"kind": "train", "step": s} for s in range(6)),
               {"kind": "val", "step": 4}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert truncate_metrics(run_dir, 4) == 3
    kept = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert kept == records[:5]


def _shards(tmp_path: Path, corrupt: str | None = None) -> Path:
    from conftest import make_docs

    tmp_path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in (("t_train_000000.bin", 40), ("t_train_000001.bin", 40), ("t_val_000000.bin", 20)):
        write_shard(tmp_path / name, np.concatenate(make_docs(rng, n, 40, 400)))
    if corrupt:
        path = tmp_path / corrupt
        tokens = np.memmap(path, dtype=np.uint16, mode="r+", offset=HEADER_BYTES)
        tokens[len(tokens) // 2] = 60000  # an id past the GPT-2 vocab
        tokens.flush()
    return tmp_path


def test_a_corrupt_second_shard_is_refused_before_a_run_dir_exists(tmp_path, capsys):
    data = _shards(tmp_path / "data", corrupt="t_train_000001.bin")
    assert train(_nano(data, tmp_path / "runs", "x")) == 2
    err = capsys.readouterr().err
    assert "t_train_000001.bin: token id 60000 >= vocab size" in err
    assert not (tmp_path / "runs" / "x").exists()


def test_validation_smaller_than_the_ranks_is_refused(tmp_path, capsys):
    data = _shards(tmp_path / "data")
    short = np.concatenate([[BOS_ID], np.arange(300)]).astype(np.uint16)
    write_shard(data / "t_val_000000.bin", short)
    cfg = _nano(data, tmp_path / "runs", "x")
    cfg.data.val_tokens_per_batch = 512
    cfg.data.val_tokens = 4096
    assert train(cfg) == 2
    err = capsys.readouterr().err
    assert "validation: 301 tokens" in err and "--val-tokens-per-batch 512" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("argv,needle", [
    (["--preset", "small-gpu"], "--preset small-gpu needs a CUDA GPU"),
    (["--preset", "speedrun"], "--preset speedrun needs a CUDA GPU"),
    (["--device", "cuda"], "--device cuda: no CUDA device is available"),
    (["--preset", "cpu-tiny", "--set", "train.ngram_accumulate=sorted"],
     "--set train.ngram_accumulate=sorted runs a CUDA kernel and this run is on the CPU"),
    (["--preset", "cpu-tiny", "--set", "train.ngram_accumulate=vector_atomic"],
     "--set train.ngram_accumulate=vector_atomic runs a CUDA kernel and this run is on the CPU"),
    (["--preset", "cpu-tiny", "--mlp-kernel", "quack"],
     "--mlp-kernel quack runs a CUDA kernel and this run is on the CPU"),
    (["--preset", "cpu-tiny", "--set", "train.qk_norm_rope=triton"],
     "--set train.qk_norm_rope=triton runs a CUDA kernel and this run is on the CPU"),
    (["--preset", "cpu-tiny", "--set", "model.attention_backend=fa4"],
     "--set model.attention_backend: attention backend 'fa4' cannot run on cpu"),
])
def test_gpu_settings_on_a_cpu_machine_exit_2(argv, needle, tmp_path, capsys):
    cfg = config_mod.parse([*argv, "--runs-dir", str(tmp_path)])
    assert train(cfg) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and "cpu" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv,needle", [
    (["--val-every", "0"], "argument --val-every: 0 must be >= 1"),
    (["--save-every", "5"], "--save-every 5: checkpoints can only be taken every 2 steps"),
    (["--val-tokens", "100"], "--val-tokens 100: smaller than one validation batch"),
    (["--run-id", "a/b"], "--run-id 'a/b': must be a plain folder name"),
])
def test_bad_values_name_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        config_mod.parse(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
