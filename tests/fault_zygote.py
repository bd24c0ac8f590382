"""Fault injection on the real trainer, forked from one process that imported torch once (not a
test module: tests/test_faults.py runs it as `python tests/fault_zygote.py MODE SHARDS OUT`).

Each scenario forks a child that runs real trainer code and is killed (SIGKILL) or signalled
(SIGTERM / SIGINT) from here at a chosen moment; what it left on disk is then checked here and
written to OUT/results.json for the test to assert on. Forking keeps each try at a fraction of a
second instead of a fresh interpreter's ~5 s of imports. Everything runs on one intra-op thread
(OMP_NUM_THREADS=1), so no thread pool crosses a fork.

Modes:
  kill     20 SIGKILLs at random moments of checkpoint saves (new steps and swaps over an existing
           step), then: every folder under a resumable name validates, the newest complete one
           equals the uninterrupted run's checkpoint of that step tensor for tensor, and a resume
           from it continues exactly.
  signals  SIGTERM mid-step, SIGTERM mid-save, SIGINT mid-step and Ctrl-C twice (SIGINT, SIGINT) during the
           stop's save (the two mid-save cases hold the save before its swap until the signal has
           arrived, so it cannot finish first): exit codes, steps trained after the signal, the checkpoint at the stop
           step, and resumes in place equal the uninterrupted run.
  ranks    2 gloo ranks: SIGTERM to rank 1 alone stops both at the same step with one checkpoint
           (both ranks' shards) that resumes exactly; SIGKILL of rank 1 makes rank 0 exit with an
           error naming rank 1.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from micro import nano_config  # noqa: E402
from mp_utils import free_port, set_rank_env  # noqa: E402

from track_1_short.distributed import init_distributed  # noqa: E402
from track_1_short.report import MetricsLog  # noqa: E402
from track_1_short.train import train  # noqa: E402
from track_1_short.trainer import checkpoint  # noqa: E402
from track_1_short.trainer.build import build_run, make_loader, make_spec  # noqa: E402
from track_1_short.trainer.step import train_step  # noqa: E402
from track_1_short.trainer.run_dir import claim_run_dir  # noqa: E402
from track_1_short.trainer.stop import GracefulStop  # noqa: E402


def config(shards: Path, runs: Path, run_id: str, **train_kw):
    return nano_config(shards, runs, run_id, **train_kw)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in MetricsLog.read(run_dir) if r["kind"] == "train"}


def flat_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint by its flat key (trainer.json aside)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / (path.name + ".flat.pt")
    dcp_to_torch_save(str(path), str(out))
    state = torch.load(out, weights_only=False)
    out.unlink()
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value
    walk("", state)
    return flat


def same_state(a: Path, b: Path) -> bool:
    fa, fb = flat_state(a), flat_state(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def fork(fn) -> int:
    """Run fn() in a forked child that exits with its return value; returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code if isinstance(code, int) else 0)
    return pid


def exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def wait_for(predicate, timeout_s: float = 120.0, poll_s: float = 0.002) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError("the child never reached the expected state")
        time.sleep(poll_s)


def resumable_names(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.glob("ckpt_step*") if p.suffix in ("", ".old") and p.is_dir()]


# ---------------------------------------------------------------- kill mode

def kill_mode(shards: Path, out: Path, tries: int = 20) -> dict:
    rng = random.Random(1234)
    assert train(config(shards, out, "reference", save_every=2)) == 0
    reference = out / "reference"
    cfg = config(shards, out, "killed", save_every=2)
    handle = claim_run_dir(out / "killed")
    ctx = init_distributed(60, "cpu")
    run = build_run(make_spec(cfg, ctx, out / "killed"), GracefulStop(ctx))
    spec, parts, progress = run.spec, run.parts, run.progress
    parts.model.set_prefix_table(parts.prefix_table)  # as the trainer does before the timed run
    progress.loader = make_loader(spec)
    handle.release()  # the children hold no lock: the dir is this process's throughout

    def train_to(steps_done: int) -> None:
        while progress.steps_done < steps_done:
            train_step(spec, parts, progress.steps_done, progress.loader, run.log.timer)
            progress.steps_done += 1

    def save_twice() -> int:
        checkpoint.save_run(spec, parts, progress, progress.steps_done)  # a new step: rename-in
        progress.last_saved_step = None
        checkpoint.save_run(spec, parts, progress, progress.steps_done)  # again: the swap over it
        return 0

    train_to(2)
    start = time.monotonic()
    assert exit_code(fork(save_twice)) == 0
    window_s = time.monotonic() - start  # one unkilled pair of saves, forking included
    rows = []
    for i in range(tries):
        if i and i % 4 == 0 and progress.steps_done < 12:
            # a trainer moves on only after its save completed (a kill ends it): one unkilled
            # save of this step first, so four early kills in a row cannot leave it unsaved
            assert exit_code(fork(save_twice)) == 0
            train_to(progress.steps_done + 2)
        delay = rng.uniform(0, window_s)
        pid = fork(save_twice)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        exit_code(pid)
        broken = []
        for path in resumable_names(out / "killed"):
            try:
                checkpoint.validate_checkpoint(path)
            except checkpoint.CheckpointError as e:
                broken.append(f"{path.name}: {e}")
        latest = checkpoint.find_latest(out / "killed")
        equal = latest is not None and same_state(latest.path, checkpoint.checkpoint_path(
            reference, latest.steps_done))
        left = sorted(p.name for p in (out / "killed").glob("ckpt_step*"))
        rows.append({"try": i, "delay_s": delay, "steps_trained": progress.steps_done, "broken": broken,
                     "latest": None if latest is None else latest.steps_done,
                     "latest_name": None if latest is None else latest.path.name,
                     "equals_reference": equal, "left": left})
    progress.loader.close()
    # what a later run finds: recovery under the lock, then a resume of the newest checkpoint
    handle = claim_run_dir(out / "killed", resume_in_place=True)
    handle.release()
    latest = checkpoint.find_latest(out / "killed")
    after_recovery = sorted(p.name for p in (out / "killed").glob("ckpt_step*"))
    rc = train(config(shards, out, "resumed", resume=latest.path))
    ref, res = losses(reference), losses(out / "resumed")
    return {"window_s": window_s, "tries": rows, "after_recovery": after_recovery,
            "resumed_from": latest.steps_done, "resume_rc": rc,
            "resume_exact": {str(s): res[s] for s in res} == {str(s): ref[s] for s in res},
            "resumed_steps": sorted(res)}


# ---------------------------------------------------------------- signals mode

def _signal_run(shards: Path, out: Path, run_id: str, signals: list[int], trigger, *, between=None,
                child_setup=None, **train_kw) -> dict:
    """Fork a run, send `signals` (one after another) once trigger(run_dir) holds, then report
    its exit code, the steps it trained after the first signal and what it left. Before each
    further signal, between(run_dir) must hold (two signals sent back to back can merge into one
    pending signal). child_setup() runs in the child before the trainer."""
    assert len(signals) == 1 or between is not None, "a second signal needs a between condition"
    run_dir = out / run_id

    def child():
        if child_setup is not None:
            child_setup()
        return train(config(shards, out, run_id, **train_kw))
    pid = fork(child)
    wait_for(lambda: trigger(run_dir))
    trained_at_signal = max(losses(run_dir), default=-1) if (run_dir / "metrics.jsonl").exists() else -1
    sent = time.monotonic()
    for i, sig in enumerate(signals):
        if i:
            wait_for(lambda: between(run_dir))
        os.kill(pid, sig)
    rc = exit_code(pid)
    stop = [r for r in MetricsLog.read(run_dir) if r["kind"] == "stop"]
    trained = max(losses(run_dir), default=-1)
    latest = checkpoint.find_latest(run_dir)
    return {"rc": rc, "exit_s": time.monotonic() - sent, "trained_at_signal": trained_at_signal,
            "trained": trained, "stop_record": stop[0] if stop else None,
            "latest": None if latest is None else latest.steps_done,
            "left": sorted(p.name for p in run_dir.glob("ckpt_step*"))}


def _hold_save_at_swap(step: int, run_dir: Path, *, until_second: bool):
    """A child_setup: the save of `step` stops just before its swap (its `.tmp` complete) and
    marks `<run_dir>.held`; it goes on once the trainer has received a signal (marking
    `<run_dir>.signalled`), or with `until_second` waits for a second signal to abort it (60 s at
    most, then goes on, and the test sees a stop record). A save that finished before the signal
    came (it raced on a loaded machine) is thus impossible."""
    def setup():
        original = checkpoint.swap_in

        def held_swap_in(tmp: Path, final: Path) -> None:
            if final.name == checkpoint.checkpoint_path(run_dir, step).name:
                Path(f"{run_dir}.held").touch()
                stop = signal.getsignal(signal.SIGINT).__self__  # the trainer's GracefulStop
                wait_for(lambda: stop.requested, timeout_s=60.0)
                Path(f"{run_dir}.signalled").touch()
                if until_second:
                    time.sleep(60.0)  # the second signal's handler exits during this sleep
            original(tmp, final)
        checkpoint.swap_in = held_swap_in
    return setup


def _marked(suffix: str):
    return lambda run_dir: Path(f"{run_dir}{suffix}").exists()


def _has_train_step(step: int):
    def check(run_dir: Path) -> bool:
        path = run_dir / "metrics.jsonl"
        return path.exists() and step in losses(run_dir)
    return check


def signals_mode(shards: Path, out: Path) -> dict:
    assert train(config(shards, out, "reference")) == 0
    ref = losses(out / "reference")
    results = {
        "sigterm_step": _signal_run(shards, out, "sigterm-step", [signal.SIGTERM], _has_train_step(4)),
        "sigterm_save": _signal_run(
            shards, out, "sigterm-save", [signal.SIGTERM], _marked(".held"), save_every=4,
            child_setup=_hold_save_at_swap(4, out / "sigterm-save", until_second=False)),
        "sigint_step": _signal_run(shards, out, "sigint-step", [signal.SIGINT], _has_train_step(2)),
        "double_sigint": _signal_run(
            shards, out, "double", [signal.SIGINT, signal.SIGINT], _marked(".held"), save_every=2,
            between=_marked(".signalled"),
            child_setup=_hold_save_at_swap(4, out / "double", until_second=True)),
    }
    for name in ("sigterm_step", "sigterm_save", "sigint_step"):
        run_id = name.replace("_", "-")
        if results[name]["rc"] in (130, 143):  # resume in place, from the run dir
            results[name]["resume_rc"] = train(config(shards, out, run_id, resume=out / run_id))
            results[name]["resume_exact"] = losses(out / run_id) == ref
    return results


# ---------------------------------------------------------------- ranks mode

def _ranks(shards: Path, out: Path, run_id: str, **train_kw) -> list[int]:
    """Fork 2 gloo ranks of one run (1 micro-step each); returns their pids. Each rank's stderr
    goes to OUT/<run_id>.rank<r>.err."""
    port = free_port()

    def rank_fn(rank: int):
        def fn():
            err = os.open(out / f"{run_id}.rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(err, 2)
            set_rank_env(rank, 2, port)
            cfg = config(shards, out, run_id, timeout_s=60.0, **train_kw)
            cfg.data.slices_per_step, cfg.data.val_tokens = 2, 1024  # a val batch per rank
            return train(cfg)
        return fn
    return [fork(rank_fn(r)) for r in range(2)]


def ranks_mode(shards: Path, out: Path) -> dict:
    ref = _ranks(shards, out, "reference2")
    ref_rc = [exit_code(pid) for pid in ref]
    if ref_rc != [0, 0]:
        raise RuntimeError(f"the 2-rank reference run failed: {ref_rc} (see {out}/reference2.rank*.err)")
    # SIGTERM to rank 1 only: both stop at the same boundary, one checkpoint with both shards
    pids = _ranks(shards, out, "term2")
    wait_for(lambda: _has_train_step(3)(out / "term2"))
    os.kill(pids[1], signal.SIGTERM)
    term_rc = [exit_code(pid) for pid in pids]
    latest = checkpoint.find_latest(out / "term2")
    stops = [r["step"] for r in MetricsLog.read(out / "term2") if r["kind"] == "stop"]
    resumed = _ranks(shards, out, "term2", resume=out / "term2")
    resume_rc = [exit_code(pid) for pid in resumed]
    # SIGKILL of rank 1: rank 0 names it
    pids = _ranks(shards, out, "dead2")
    wait_for(lambda: _has_train_step(3)(out / "dead2"))
    killed = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    dead_rc = [exit_code(pid) for pid in pids]
    return {"reference_rc": ref_rc, "term_rc": term_rc, "stop_steps": stops,
            "latest": None if latest is None else latest.steps_done,
            "shards": sorted(p.name for p in latest.path.glob("*.distcp")) if latest else [],
            "resume_rc": resume_rc,
            "resume_exact": losses(out / "term2") == losses(out / "reference2"),
            "dead_rc": dead_rc, "dead_exit_s": time.monotonic() - killed,
            "dead_rank0_err": (out / "dead2.rank0.err").read_text()[-2000:]}


def main() -> int:
    mode, shards, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    modes = {"kill": kill_mode, "signals": signals_mode, "ranks": ranks_mode}
    result = modes[mode](shards, out)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
