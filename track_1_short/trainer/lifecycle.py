"""A run from the config to its exit code: checks, claim, build, warmup + capture, reset, census,
seal, timed run, finish; and what each way out returns.

Order (`train`): the cuBLAS setting (train.blas, perf/blas.py: before any CUDA call) ->
device check (before the process group binds a device) -> process group ->
preflight (every check that can refuse the run, before anything is written) -> claim the run dir
(rank 0, lock) -> build (spec, model with every systems concern, data) -> warmup + capture ->
in-place reset, census compared, runner sealed -> resume (if asked) -> timed run -> finish
(final validation, checkpoint, summary, plots).

Exit codes: 0 done (and --warmup-only); 2 a bad input found by a check (data, checkpoint, run dir,
device, step window, compile cache) with a message naming it and the fix, leaving no run dir when
found before the first timed step; 143 / 130 stopped by SIGTERM / SIGINT (checkpoint at the stop
step, unless it came before training); 1 a rank lost mid-run (named). Timing (facts section 5):
the clock covers data, forward, backward and optimizer; it starts after the reset and seal and
stops around every validation and checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from track_1_short import report
from track_1_short.config import RunConfig
from track_1_short.data import DataError, num_val_slices
from track_1_short.distributed import (DistributedContext, destroy_distributed, init_distributed,
                                       is_comm_failure, lost_ranks)
from track_1_short.perf import blas, compile_cache
from track_1_short.perf.compile_cache import CompileCacheError
from track_1_short.perf.cuda_graphs import baked_addresses
from track_1_short.trainer import checkpoint
from track_1_short.trainer.build import (build_run, describe_ngram_rows, describe_strategies, make_loader,
                                         make_spec)
from track_1_short.trainer.checkpoint import CheckpointError
from track_1_short.trainer.phases import timed_run, validate, warmup_and_capture
from track_1_short.trainer.preflight import (Preflight, PreflightError, check_device,
                                             describe_capacity, preflight)
from track_1_short.trainer.run_dir import RunDir, RunDirError, claim_run_dir, truncate_metrics
from track_1_short.trainer.snapshot import restore_state, snapshot_state
from track_1_short.trainer.state import Run
from track_1_short.trainer.stop import GracefulStop, StoppedBeforeTraining
from track_1_short.trainer.summary import write_summary, write_warmup_report

EXIT_ERRORS = (DataError, CheckpointError, CompileCacheError, RunDirError, PreflightError)


@contextmanager
def deterministic_mode(enabled: bool):
    """--deterministic: torch.use_deterministic_algorithms(True, warn_only=True) for the run, with
    cuBLAS's workspace setting it needs (CUBLAS_WORKSPACE_CONFIG, when not set already) and without
    filling new tensors with NaN (torch's default in this mode; the trainer reads no uninitialised
    memory, and the fill costs a kernel per allocation). inductor follows the same switch (it
    falls back to deterministic index_put/scatter instead of atomic adds). Ops with no
    deterministic kernel warn, naming the op, instead of failing the run. Restores the previous
    settings on exit, so runs in one process (tests) do not leak the mode."""
    if not enabled:
        yield
        return
    prev = (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.utils.deterministic.fill_uninitialized_memory = prev[2]
        if prev[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def train(cfg: RunConfig, graph_backend=None) -> int:
    """The whole run; returns the process exit code (module docstring). graph_backend: None for
    CUDA graphs; the CPU stand-in (capture_support.RecordingGraphBackend) for tests."""
    with ExitStack() as stack:
        try:  # before any CUDA call: cuBLAS reads its workspace setting once per process
            stack.enter_context(blas.applied(cfg.train.blas))
        except blas.BlasSettingError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if cfg.train.blas != "default" and os.environ.get("RANK", "0") == "0":
            print(blas.describe(cfg.train.blas), flush=True)
        stack.enter_context(deterministic_mode(cfg.train.deterministic))
        return _train(cfg, graph_backend)


def _claim(cfg: RunConfig, ctx: DistributedContext, pre: Preflight) -> RunDir | None:
    """Rank 0 claims the run dir (lock, clean-up); every rank learns whether it could."""
    handle, error = None, None
    if ctx.is_main:
        try:
            handle = claim_run_dir(pre.run_dir, overwrite=cfg.train.overwrite,
                                   resume_in_place=pre.resume_in_place)
        except RunDirError as e:
            error = str(e)
    if ctx.world_size > 1:
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0, group=ctx.health_group)
        error = box[0]
    if error is not None:
        raise RunDirError(error)
    return handle


def prepare_run(cfg: RunConfig, ctx: DistributedContext, pre: Preflight, stop: GracefulStop,
             graph_backend, started: float) -> Run:
    """Build, warm up + capture (or skip), reset, census, seal: everything before the timed run."""
    cache_log = compile_cache.load(cfg.train.compile_cache) if cfg.train.compile_cache else {}
    run = build_run(make_spec(cfg, ctx, pre.run_dir), stop, graph_backend)
    run.log.started, run.log.compile_cache = started, cache_log
    if ctx.is_main:
        if cache_log:
            print(f"compile cache: {cache_log}", flush=True)
        print(describe_strategies(run.parts.model), flush=True)
        print(describe_ngram_rows(run.parts), flush=True)
        print(f"run dir {pre.run_dir}; attention backend {run.parts.model.attention_backend}; "
              f"{ctx.world_size} rank(s) x {run.spec.micro_steps} micro-step(s); validation "
              f"{num_val_slices(run.val_tokens.size, cfg.data.val_tokens_per_batch)} batch(es) of "
              f"{cfg.data.val_tokens_per_batch} tokens", flush=True)
        report.write_json_atomic(pre.run_dir / "config.json", cfg.to_dict())
    initial = snapshot_state(run.parts)
    if cfg.train.compile or cfg.graphs.mode != "off":
        warmup_and_capture(run)
        parts = run.parts
        census_before = baked_addresses.take_census(parts.model, parts.runner, parts.optimizer)
        restore_state(parts, initial)  # in place: parameters, optimizer, tables, YaRN
        baked_addresses.compare(census_before, baked_addresses.take_census(
            parts.model, parts.runner, parts.optimizer))
        if cfg.train.compile_cache and ctx.is_main:
            # every graph of the run is compiled now (the summary's compiles show none later)
            run.log.compile_cache["saved"] = compile_cache.save(cfg.train.compile_cache)
    elif ctx.is_main:
        print("warmup skipped: an uncompiled eager model has nothing to compile or capture", flush=True)
    run.parts.runner.seal()
    run.parts.optimizer.seal()
    return run


def _resume(run: Run, pre: Preflight) -> int:
    """--resume: load in place (after the claim's recovery renamed an orphaned .old back, so the
    checkpoint is re-resolved); returns the first step to run."""
    info = pre.resume
    if pre.resume_in_place:
        info = checkpoint.resolve_resume(info.path.with_suffix("") if info.path.suffix == ".old"
                                         else info.path)
    loader_state = checkpoint.resume_run(run.spec, run.parts, run.progress, info)
    run.progress.loader = make_loader(run.spec, state=loader_state)
    if pre.resume_in_place and run.spec.ctx.is_main:
        truncate_metrics(run.spec.run_dir, info.steps_done)
    return info.steps_done


def _finish(run: Run, start_step: int) -> int:
    """After the timed run: final validation and checkpoint, summary and plots; or, after a
    signal, the stop checkpoint and how to resume. Returns the exit code."""
    spec, stop, progress = run.spec, run.stop, run.progress
    if stop.requested:
        steps_done = progress.steps_done
        path = checkpoint.save_run(spec, run.parts, progress, steps_done)
        run.log.metrics.log(kind="stop", step=steps_done, signal=stop.signal_name,
                            checkpoint=str(path) if path else None)
        if spec.ctx.is_main:
            where = (f"checkpoint {path}; resume with the same flags plus --resume {spec.run_dir}"
                     if path else "no checkpoint could be taken at this step")
            print(f"stopped by {stop.signal_name} after step {steps_done}: {where}", flush=True)
        return stop.exit_code
    if spec.cfg.train.validation:
        validate(run, spec.num_steps)
    if spec.cfg.train.save_final:
        checkpoint.save_run(spec, run.parts, progress, spec.num_steps)
    if spec.ctx.is_main:
        summary = write_summary(run, start_step)
        print(f"done: {summary['steps']} steps, {summary['tokens_per_rank']} tokens/rank, "
              f"train time {summary['train_time_s']:.1f} s, final val loss "
              f"{summary['final_val_loss']:.4f}; summary {spec.run_dir / 'summary.json'}", flush=True)
    return 0


def _report_lost_ranks(ctx: DistributedContext, error: RuntimeError, run_dir: Path | None) -> None:
    """A collective failed because a peer is gone: name it (distributed.lost_ranks) and say how to
    go on. Rank 0 hosts the rendezvous store: if it is the one gone, the store cannot answer."""
    first_line = str(error).strip().splitlines()[0][:200]
    try:
        lost = lost_ranks(ctx, "after-failure", wait_s=10.0)
        who = f"rank(s) {lost} stopped answering" if lost else "every rank still answers"
    except Exception:  # the store is gone with rank 0
        who = "rank 0 (it hosts the rendezvous store) stopped answering"
    where = f"; resume with --resume {run_dir} once every rank runs" if run_dir else ""
    print(f"error: rank {ctx.rank}: a collective failed ({first_line}): {who}{where}",
          file=sys.stderr, flush=True)


def _run_phases(cfg: RunConfig, ctx: DistributedContext, pre: Preflight, stop: GracefulStop,
                graph_backend, started: float) -> int:
    """From the build to the exit code (the run dir is claimed)."""
    run = prepare_run(cfg, ctx, pre, stop, graph_backend, started)
    try:
        if cfg.train.warmup_only:
            if ctx.is_main:
                write_warmup_report(run)
            return 0
        run.parts.model.set_prefix_table(run.parts.prefix_table)
        start_step = _resume(run, pre) if pre.resume is not None else 0
        timed_run(run, start_step)
        return _finish(run, start_step)
    finally:
        if run.progress.loader is not None:
            run.progress.loader.close()


def _train(cfg: RunConfig, graph_backend) -> int:
    started = time.perf_counter()
    try:
        check_device(cfg)  # before the process group binds a device
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ctx = init_distributed(cfg.train.timeout_s, None if cfg.train.device == "auto" else cfg.train.device)
    if ctx.is_main and cfg.train.deterministic:
        print("deterministic mode: torch.use_deterministic_algorithms(True, warn_only=True)", flush=True)
    handle, pre, stop = None, None, GracefulStop(ctx)
    try:
        with stop:
            pre = preflight(cfg, ctx)
            cfg = pre.cfg  # document capacities resolved from the data
            if ctx.is_main:
                print(describe_capacity(pre.capacity), flush=True)
            handle = _claim(cfg, ctx, pre)
            return _run_phases(cfg, ctx, pre, stop, graph_backend, started)
    except StoppedBeforeTraining:
        if ctx.is_main:
            print(f"stopped by {stop.signal_name} before the first training step: nothing to resume",
                  file=sys.stderr, flush=True)
        return stop.exit_code
    except EXIT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if ctx.world_size == 1 or not is_comm_failure(e):
            raise
        _report_lost_ranks(ctx, e, pre.run_dir if pre else None)
        return 1
    finally:
        if handle is not None:
            handle.release(remove=not _trained(handle.path, cfg))
        destroy_distributed()


def _trained(run_dir: Path, cfg: RunConfig) -> bool:
    """Whether the run dir holds a result worth keeping (a train record, or warmup.json)."""
    return (run_dir / "metrics.jsonl").is_file() or (cfg.train.warmup_only and
                                                     (run_dir / "warmup.json").is_file())
