"""report.compare_runs and its CLI: the graphs on/off comparison the main-job issue asks for.

Scope: synthetic summary.json files (the trainer's keys) in temporary run directories; numbers
chosen so every ratio and difference is known exactly. The record's val curve (`--record`) is read
from tests/fixtures/record_loss/loss.jsonl, the record harness's real output (trimmed). Hardware:
CPU, < 5 s.
Run: `.venv/bin/python -m pytest tests/test_report.py -q`.
"""

import json
from pathlib import Path

import pytest

from track_1_short import report


def _summary(train_time_s: float, stage_ms: dict[str, float], **over) -> dict:
    s = {"preset": "small-gpu", "world_size": 1, "micro_steps": 8, "steps": 188, "start_step": 0,
         "graphs": "on", "git_revision": "abc", "device": "test", "train_time_s": train_time_s,
         "wall_s": 300.0, "warmup_s": 150.0, "tokens_per_s_per_gpu": 1.0e5, "peak_memory_gib": 60.0,
         "final_val_loss": 7.4, "compiles": {"warmup": 8, "validation": 0, "timed": 0},
         "ms_per_step_by_stage": {st: {"steps": 60, "median_ms": ms} for st, ms in stage_ms.items()}}
    return s | over


def _run_dir(tmp_path, name: str, summary: dict):
    d = tmp_path / name
    d.mkdir()
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_compare_reports_differences_against_the_first_run(tmp_path):
    off = _run_dir(tmp_path, "off", _summary(100.0, {"A": 300.0, "B": 600.0}, graphs="off"))
    on = _run_dir(tmp_path, "on", _summary(90.0, {"A": 270.0, "B": 600.0}))
    result = report.compare_runs({"off": off, "on": on}, tmp_path / "cmp")
    assert result["baseline"] == "off"
    v = result["versus_baseline"]["on"]
    assert v["train_time_s_diff"] == pytest.approx(-10.0) and v["train_time_ratio"] == pytest.approx(0.9)
    assert v["stages"]["A"] == {"median_ms_diff": pytest.approx(-30.0), "ratio": pytest.approx(0.9)}
    assert v["stages"]["B"]["ratio"] == pytest.approx(1.0)
    assert v["stages_unmatched"] == []
    assert result["ms_per_step_by_stage"] == {"off": {"A": 300.0, "B": 600.0},
                                              "on": {"A": 270.0, "B": 600.0}}
    assert result["runs"]["off"]["graphs"] == "off" and result["runs"]["on"]["graphs"] == "on"
    written = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert written["versus_baseline"]["on"]["train_time_ratio"] == pytest.approx(0.9)
    assert (tmp_path / "cmp" / "ms_per_step_compare.png").stat().st_size > 0


@pytest.mark.parametrize("field,value", [("preset", "speedrun"), ("world_size", 2), ("steps", 50)])
def test_compare_refuses_runs_that_are_not_comparable(tmp_path, field, value):
    a = _run_dir(tmp_path, "a", _summary(100.0, {"A": 300.0}))
    b = _run_dir(tmp_path, "b", _summary(100.0, {"A": 300.0}, **{field: value}))
    with pytest.raises(ValueError, match=f"{field} differs"):
        report.compare_runs({"a": a, "b": b}, tmp_path / "cmp")
    assert not (tmp_path / "cmp" / "compare.json").exists()


def test_compare_names_a_missing_summary(tmp_path):
    a = _run_dir(tmp_path, "a", _summary(100.0, {"A": 300.0}))
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match=r"b/summary.json does not exist"):
        report.compare_runs({"a": a, "b": tmp_path / "b"}, tmp_path / "cmp")


def test_compare_names_a_summary_that_is_not_a_trainer_summary_and_unmatched_stages(tmp_path):
    a = _run_dir(tmp_path, "a", _summary(100.0, {"A": 300.0, "B": 500.0}))
    bad = _run_dir(tmp_path, "bad", {"preset": "small-gpu"})
    with pytest.raises(ValueError, match=r"has no \['train_time_s', 'ms_per_step_by_stage'\]"):
        report.compare_runs({"a": a, "bad": bad}, tmp_path / "cmp")
    b = _run_dir(tmp_path, "b", _summary(100.0, {"A": 300.0, "C": 900.0}))
    result = report.compare_runs({"a": a, "b": b}, tmp_path / "cmp")
    assert set(result["versus_baseline"]["b"]["stages"]) == {"A"}
    assert result["versus_baseline"]["b"]["stages_unmatched"] == ["B", "C"]


def test_cli_writes_the_comparison_and_rejects_bad_run_specs(tmp_path, capsys):
    off = _run_dir(tmp_path, "off", _summary(100.0, {"A": 300.0}, graphs="off"))
    on = _run_dir(tmp_path, "on", _summary(95.0, {"A": 285.0}))
    assert report.main(["compare", "--run", f"off={off}", "--run", f"on={on}",
                        "--out", str(tmp_path / "cmp")]) == 0
    assert "on vs off: train time 0.9500x" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        report.main(["compare", "--run", str(off), "--run", f"on={on}", "--out", str(tmp_path / "x")])
    assert "expected LABEL=RUN_DIR" in capsys.readouterr().err


def test_stage_phase_ms_summarises_phases_per_stage():
    times = [{"stage": "A", "step": 0, "step_ms": 30.0, "phase_ms": {"micro_steps": 20.0, "optimizer": 10.0}},
             {"stage": "A", "step": 1, "step_ms": 50.0,
              "phase_ms": {"micro_steps": 22.0, "optimizer": 8.0, "ngram_update": 20.0}},
             {"stage": "B", "step": 2, "step_ms": 40.0, "phase_ms": {"micro_steps": 40.0}}]
    out = report.stage_phase_ms(times)
    assert out["A"]["micro_steps"] == {"steps": 2, "median_ms": 21.0, "mean_ms": 21.0,
                                       "mean_ms_per_step": 21.0}
    # the event ran on one of A's two steps: 20 ms when it runs, 10 ms per average step
    assert out["A"]["ngram_update"]["median_ms"] == 20.0
    assert out["A"]["ngram_update"]["mean_ms_per_step"] == 10.0
    assert set(out["B"]) == {"micro_steps"}


RECORD_LOSS = Path(__file__).resolve().parent / "fixtures" / "record_loss"  # the harness's loss.jsonl


def test_compare_overlays_the_record_val_curve_beside_one_run(tmp_path, capsys):
    curve = [{"step": 0, "val_loss": 10.8, "train_time_s": 0.0}, {"step": 40, "val_loss": 6.0, "train_time_s": 9.0}]
    ours = _run_dir(tmp_path, "ours", _summary(100.0, {"A": 300.0}, val_curve=curve))
    result = report.compare_runs({"ours": ours}, tmp_path / "cmp", record=RECORD_LOSS / "loss.jsonl")
    rec = result["record"]
    assert [r["step"] for r in rec["val_curve"]] == [0, 10, 20, 30, 40, 41]
    assert rec["final_val_loss"] == pytest.approx(6.17502)
    assert rec["val_curve"][1]["train_time_s"] == pytest.approx(3.59087954)
    assert result["versus_baseline"] == {}
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["record"]["source"].endswith("loss.jsonl")
    assert (tmp_path / "cmp" / "val_loss_compare.png").stat().st_size > 0
    # the CLI: the record's folder is enough, and one --run alone is still refused
    assert report.main(["compare", "--run", f"ours={ours}", "--record", str(RECORD_LOSS),
                        "--out", str(tmp_path / "cli")]) == 0
    assert "6 validations, final val loss 6.1750" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        report.main(["compare", "--run", f"ours={ours}", "--out", str(tmp_path / "x")])
    assert "or one run and a record curve" in capsys.readouterr().err


def test_record_curve_reader_refuses_our_metrics_and_other_files(tmp_path):
    ours = tmp_path / "metrics.jsonl"
    ours.write_text(json.dumps({"kind": "val", "step": 0, "val_loss": 10.8, "train_time_s": 0.0}) + "\n")
    with pytest.raises(ValueError, match="is a track_1_short metrics.jsonl"):
        report.read_record_val_curve(ours)
    other = tmp_path / "other.jsonl"
    other.write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="has no line of kind"):
        report.read_record_val_curve(other)
    warm = tmp_path / "warm" / "loss.jsonl"
    warm.parent.mkdir()
    warm.write_text('{"kind": "warmup", "step": 0}\n')
    with pytest.raises(ValueError, match="no validation line"):
        report.read_record_val_curve(warm.parent)
    with pytest.raises(ValueError, match="does not exist"):
        report.read_record_val_curve(tmp_path / "none.jsonl")


def test_git_tree_names_the_files_as_they_are_even_where_git_is_older(tmp_path):
    """A copied working tree whose .git lags: git_tree names the files that are there, git_revision
    the stale commit; after committing them, the tree equals that commit's ^{tree}."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    first = git("rev-parse", "HEAD")
    assert report.git_tree(tmp_path) == git("rev-parse", "HEAD^{tree}")

    (tmp_path / "a.py").write_text("x = 2\n")     # the carried files move on, .git does not
    (tmp_path / "b.py").write_text("y = 1\n")     # a new file, untracked there
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.bin").write_text("not code\n")
    moved = report.git_tree(tmp_path)
    assert moved != git("rev-parse", "HEAD^{tree}")
    assert report.git_revision(tmp_path) == first + "-dirty"
    assert git("status", "--porcelain") != ""                     # own index untouched
    assert "b.py" not in git("ls-files")

    git("add", "-A")
    git("commit", "-qm", "two")
    assert moved == git("rev-parse", "HEAD^{tree}")
    assert report.git_tree(tmp_path / "nowhere") == "unknown"
