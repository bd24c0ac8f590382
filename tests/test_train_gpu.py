"""The trainer on one GPU: graphs on vs off, and resume (main-job issue, GPU bars).

Scope: the small-gpu preset (full speedrun model, stage A's key, 8 micro-steps per step on one GPU)
for 50 steps on the embedded corpus, three runs in one process:
  1. graphs on, checkpoint after step 24;
  2. graphs off (the compiled model launched eagerly), same seed and data order;
  3. graphs on, resumed from run 1's checkpoint.
Checks: train loss of 1 and 2 within 1e-2 at every step and the final val loss within 1e-2; run 3's
losses within 1e-3 of run 1's for the first RESUME_EXACT_STEPS steps after the resume and within
2e-3 after that, its final val loss within 1e-2 (26 nondeterministic steps later: measured 3.8e-3
on 2026-12-01); no compile during any timed run.

Why not 1e-3 at every step: training on the GPU is not bitwise reproducible (atomic adds in
backward kernels), and the difference grows with the steps. Measured on the H200 (2026-11-30,
fp8 off): the resumed run matched to 3 decimals up to step 36 and drifted to 1.1e-3 at step 46,
while graphs on vs off (the same kernels, replayed or launched) already differed by 4e-3 at
step 24. A state the resume failed to restore (optimizer moments, YaRN, n-gram pending gradients,
data position) shows at the first resumed steps, which keep the 1e-3 bar.
With --deterministic (torch.use_deterministic_algorithms), the resumed run must equal the
uninterrupted one exactly (test_deterministic_resume_is_exact, two more runs of 50 and 26 steps):
this separates a resume defect from kernel nondeterminism. (Passed on the H200, 2026-11-30: equal
at all 26 resumed steps, no op warned; docs/results/gpu_tests_h200_2026-11-30_s4.log.)
Hardware: one CUDA GPU; ~4 min on an H200 with a cold compile cache (the key and one validation
window compile once; runs 2 and 3 hit inductor's cache).
Run: `.venv/bin/python -m pytest -m gpu tests/test_train_gpu.py -q` (needs data/embedded and the
GPT-2 tokenizer, as ./test.sh prepares them).
"""

import json
import warnings

import pytest
import torch

from track_1_short import config as config_mod
from track_1_short.report import MetricsLog
from track_1_short.train import train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS, RESUME_AT = 50, 24
RESUME_EXACT_STEPS = 12  # steps after the resume held to 1e-3 (docstring)


def _run(embedded_dir, runs_dir, run_id: str, *extra: str) -> dict:
    argv = ["--preset", "small-gpu", "--data-dir", str(embedded_dir), "--max-steps", str(STEPS),
            "--runs-dir", str(runs_dir), "--run-id", run_id, "--log-every", "1", "--no-save-final",
            *extra]
    assert train(config_mod.parse(argv)) == 0
    run_dir = runs_dir / run_id
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = {r["step"]: r["loss"] for r in MetricsLog.read(run_dir) if r["kind"] == "train"}
    return {"summary": summary, "losses": losses, "dir": run_dir}


@pytest.fixture(scope="module")
def runs(embedded_dir, tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs")
    on = _run(embedded_dir, runs_dir, "on", "--graphs", "on", "--save-every", str(RESUME_AT))
    off = _run(embedded_dir, runs_dir, "off", "--graphs", "off")
    ckpt = on["dir"] / f"ckpt_step{RESUME_AT:06d}"
    resumed = _run(embedded_dir, runs_dir, "resumed", "--graphs", "on", "--resume", str(ckpt))
    return on, off, resumed


def test_graphs_on_off_equivalent(runs):
    on, off, _ = runs
    assert sorted(on["losses"]) == list(range(STEPS)) == sorted(off["losses"])
    diffs = {s: abs(on["losses"][s] - off["losses"][s]) for s in range(STEPS)}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= 1e-2, f"step {worst}: graphs on {on['losses'][worst]} vs off {off['losses'][worst]}"
    assert on["losses"][STEPS - 1] < on["losses"][0] - 1.0, "the run did not learn"
    val_on, val_off = on["summary"]["final_val_loss"], off["summary"]["final_val_loss"]
    assert abs(val_on - val_off) <= 1e-2, (val_on, val_off)
    for r in (on, off):
        assert r["summary"]["compiles"]["timed"] == 0, r["summary"]["compiles"]
    assert on["summary"]["capture_report"] and not off["summary"]["capture_report"]


def test_resume_continues_the_run(runs):
    on, _, resumed = runs
    assert resumed["summary"]["start_step"] == RESUME_AT
    assert sorted(resumed["losses"]) == list(range(RESUME_AT, STEPS))
    for s in range(RESUME_AT, STEPS):
        bar = 1e-3 if s < RESUME_AT + RESUME_EXACT_STEPS else 2e-3
        assert abs(resumed["losses"][s] - on["losses"][s]) <= bar, \
            f"step {s}: resumed {resumed['losses'][s]} vs uninterrupted {on['losses'][s]} (bar {bar})"
    # The final validation comes 26 nondeterministic steps after the resume: 3.8e-3 apart on the
    # H200 (2026-12-01, fused loss, compiled optimizer), the drift graphs on vs off shows too; the
    # steps right after the resume keep the 1e-3 bar, the exact check is the deterministic test.
    assert abs(resumed["summary"]["final_val_loss"] - on["summary"]["final_val_loss"]) <= 1e-2


@pytest.fixture(scope="module")
def deterministic_runs(embedded_dir, tmp_path_factory):
    """Both runs with --deterministic; also the warnings torch gave for ops that have no
    deterministic kernel (warn_only mode), so a failure below names them."""
    runs_dir = tmp_path_factory.mktemp("det_runs")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on = _run(embedded_dir, runs_dir, "on", "--graphs", "on", "--deterministic",
                  "--save-every", str(RESUME_AT))
        ckpt = on["dir"] / f"ckpt_step{RESUME_AT:06d}"
        resumed = _run(embedded_dir, runs_dir, "resumed", "--graphs", "on", "--deterministic",
                       "--resume", str(ckpt))
    nondeterministic = sorted({str(w.message) for w in caught
                               if "does not have a deterministic implementation" in str(w.message)})
    return on, resumed, nondeterministic


def test_deterministic_resume_is_exact(deterministic_runs):
    on, resumed, nondeterministic = deterministic_runs
    assert not nondeterministic, f"ops without a deterministic kernel: {nondeterministic}"
    assert sorted(resumed["losses"]) == list(range(RESUME_AT, STEPS))
    diffs = {s: abs(resumed["losses"][s] - on["losses"][s]) for s in range(RESUME_AT, STEPS)}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] == 0.0, \
        f"step {worst}: resumed {resumed['losses'][worst]} vs uninterrupted {on['losses'][worst]}"
    assert resumed["summary"]["final_val_loss"] == on["summary"]["final_val_loss"]
