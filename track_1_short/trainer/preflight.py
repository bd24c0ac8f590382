"""Up-front checks: everything a run can be refused for, found before a run dir or a model exists.

What it replaces: errors found late: a corrupt train shard reported ~20 s in (after the model build
and step-0 validation, with a run dir already created), a corrupt second shard only when the loader
reached it (step 22), `--preset small-gpu` on a CPU machine failing after 22 s inside torch
(`torch.cuda.Stream requires CUDA support`), `--device cuda` without CUDA failing in the process
group setup, a damaged checkpoint found by `dcp.load` after the whole build, a validation set
silently smaller than one batch.

Order (train.py): `check_device(cfg)` before the process group starts (it binds a CUDA device);
`preflight(cfg, ctx)` on every rank after it (the same files give every rank the same answer; the
default run id is rank 0's, broadcast). Nothing here writes: the run dir is claimed afterwards
(run_dir.claim_run_dir), so a run refused here leaves nothing behind.

Checks: the device, and on a CPU run the settings that name a CUDA kernel (--mlp-kernel quack,
optim.polar_gemms=quack, train.ngram_accumulate other than auto or index_add, an attention backend the model refuses on the CPU); every train and val shard's header, size, token range and BOS (data.check_shards,
a vectorised pass over a memmap: ~0.1 s per 100M-token shard); the validation set holds at least
one batch per rank; the document capacity of each stage's micro-batches and of a validation batch
(the cu_seqlens length its graphs bake): where the config leaves it None (every preset), the most
documents any batch of that length can hold in these shards (over every document order: the
shortest documents, each cut to max_seq_len; validation: its fixed slices), rounded up
(data.capacity_rows); a set one (--doc-capacity) must hold that many; `--resume` (a checkpoint folder or a run dir: validated whole, saved on this
world size with this global batch); where the run dir is (a resumed run continues in its
checkpoint's run dir unless `--run-id` names another). Whether an existing run dir may be used
is decided once, on rank 0, when it is claimed.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from track_1_short.config import RunConfig
from track_1_short.data import (DataError, ShardStats, capacity_rows, check_shards, load_val_tokens,
                                max_val_pieces, num_val_slices, worst_case_pieces)
from track_1_short.distributed import DistributedContext
from track_1_short.model.attention import resolve_backend
from track_1_short.perf.ngram_store import resolve_accumulate
from track_1_short.schedule import Schedule
from track_1_short.trainer.checkpoint import CheckpointError, CheckpointInfo, resolve_resume
from track_1_short.trainer.state import micro_steps_per_rank


class PreflightError(ValueError):
    """A run that cannot start as configured (device, step window); the message says what to pass."""


@dataclass(slots=True, frozen=True)
class Preflight:
    """What the checks found: the resolved config (document capacities sized from the data),
    where the run goes and what it resumes from."""

    cfg: RunConfig  # the caller's config with every None capacity resolved (a new object)
    run_dir: Path
    resume: CheckpointInfo | None
    resume_in_place: bool  # the run continues in the run dir that holds its checkpoint
    shards: ShardStats
    capacity: dict[str, dict]  # per stage and "val": {"max_docs", "rows", "from_data"}


def _accumulates_on_cpu(name: str) -> bool:
    """Whether the n-gram hold's accumulate setting runs on a CPU table (the store's own rule,
    perf/ngram_store.resolve_accumulate)."""
    try:
        resolve_accumulate(name, torch.device("cpu"))
    except ValueError:
        return False
    return True


def check_device(cfg: RunConfig) -> None:
    """Before any CUDA call: a CUDA device where the config needs one (the preset, --device cuda,
    and the CUDA-only kernels a setting names)."""
    on_cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
    if not on_cuda:
        cuda_kernels = {"--mlp-kernel quack": cfg.train.mlp_kernel == "quack",
                        "--set train.qk_norm_rope=triton": cfg.train.qk_norm_rope == "triton",
                        "--set optim.polar_gemms=quack": cfg.optim.polar_gemms == "quack",
                        f"--set train.ngram_accumulate={cfg.train.ngram_accumulate}":
                            not _accumulates_on_cpu(cfg.train.ngram_accumulate)}
        asked = next((setting for setting, on in cuda_kernels.items() if on), None)
        if asked is not None:
            raise PreflightError(f"{asked} runs a CUDA kernel and this run is on the CPU (device "
                                 f"cpu); drop it (the defaults: --mlp-kernel torch, "
                                 f"train.qk_norm_rope=torch, optim.polar_gemms=torch, "
                                 f"train.ngram_accumulate=auto) or run on a GPU host")
        try:  # the model's own rule (model/attention.resolve_backend), without touching CUDA
            resolve_backend(cfg.model.attention_backend, torch.device("cpu"))
        except ValueError as e:
            raise PreflightError(f"--set model.attention_backend: {e}") from None
    if torch.cuda.is_available():
        return
    if cfg.train.device == "cuda":
        raise PreflightError("--device cuda: no CUDA device is available on this machine "
                          "(torch.cuda.is_available() is False); pass --device cpu or run on a GPU host")
    if cfg.needs_cuda:
        raise PreflightError(f"--preset {cfg.preset} needs a CUDA GPU and none is available "
                          f"(torch.cuda.is_available() is False); on a CPU machine use "
                          f"--preset cpu-tiny")


def _check_validation(cfg: RunConfig, shards: ShardStats, world_size: int) -> None:
    available = min(shards.val_tokens, cfg.data.val_tokens)
    per_batch = cfg.data.val_tokens_per_batch
    slices = num_val_slices(available, per_batch)
    if slices < world_size:
        raise DataError(f"validation: {available} tokens (--val-tokens {cfg.data.val_tokens}, "
                        f"{shards.val_tokens} in {cfg.data.data_dir}'s val shards) make {slices} "
                        f"batch(es) of --val-tokens-per-batch {per_batch}, fewer than the "
                        f"{world_size} rank(s); raise --val-tokens or lower --val-tokens-per-batch")


def _check_steps(cfg: RunConfig, start_step: int) -> None:
    """The resumed step and the --profile-steps window inside this run's timed steps."""
    num_steps = Schedule(cfg.schedule).num_steps
    num_steps = min(num_steps, cfg.train.max_steps or num_steps)
    if start_step > num_steps:
        raise PreflightError(f"--resume: the checkpoint is at step {start_step}, past this run's "
                             f"{num_steps} steps; raise --max-steps or resume an earlier checkpoint")
    window = cfg.train.profile_steps
    if window is not None and not start_step <= window[0] < window[1] <= num_steps:
        raise PreflightError(f"--profile-steps {window[0]}:{window[1]}: outside this run's timed "
                             f"steps [{start_step}, {num_steps}); pick a window inside them")


def _stage_capacity(stage, doc_lens) -> dict:
    worst = worst_case_pieces(doc_lens, stage.tokens_per_rank, stage.max_seq_len)
    if stage.cu_seqlens_rows is None:
        return {"max_docs": worst, "rows": capacity_rows(worst), "from_data": True}
    if stage.cu_seqlens_rows - 1 < worst:
        raise DataError(f"stage {stage.name}: up to {worst} documents fit in one "
                        f"{stage.tokens_per_rank}-token micro-batch of these shards (the shortest "
                        f"documents, each cut to {stage.max_seq_len} tokens), more than its "
                        f"capacity {stage.cu_seqlens_rows - 1}; raise --doc-capacity to {worst} or "
                        f"drop it (the capacity is then sized from the data)")
    return {"max_docs": worst, "rows": stage.cu_seqlens_rows, "from_data": False}


def _resolve_capacity(cfg: RunConfig, shards: ShardStats) -> tuple[RunConfig, dict[str, dict]]:
    """Document capacity per stage and for validation (the cu_seqlens lengths the graphs bake):
    from the data where the config leaves it None, checked against the data where it is set."""
    capacity = {s.name: _stage_capacity(s, shards.train_doc_lens) for s in cfg.schedule.stages}
    val = load_val_tokens(cfg.data.data_dir, cfg.data.val_tokens)
    worst = max_val_pieces(val, cfg.data.val_tokens_per_batch)
    rows = cfg.data.val_cu_seqlens_rows
    if rows is not None and rows - 1 < worst:
        raise DataError(f"validation: a {cfg.data.val_tokens_per_batch}-token batch of "
                        f"{cfg.data.data_dir}'s val shards holds up to {worst} documents, more than "
                        f"the capacity {rows - 1}; raise --doc-capacity to {worst} or drop it")
    capacity["val"] = {"max_docs": worst, "rows": rows or capacity_rows(worst), "from_data": rows is None}
    stages = tuple(dataclasses.replace(s, cu_seqlens_rows=capacity[s.name]["rows"])
                   for s in cfg.schedule.stages)
    resolved = dataclasses.replace(
        cfg, schedule=dataclasses.replace(cfg.schedule, stages=stages),
        data=dataclasses.replace(cfg.data, val_cu_seqlens_rows=capacity["val"]["rows"]))
    return resolved, capacity


def describe_capacity(capacity: dict[str, dict]) -> str:
    """One log line: documents per batch (max in the data -> capacity) per stage and validation."""
    parts = [f"{name} {c['max_docs']} -> {c['rows'] - 1}" + ("" if c["from_data"] else " (set)")
             for name, c in capacity.items()]
    return "document capacity per batch (most the data can put in one -> capacity): " + ", ".join(parts)


def _check_resume(info: CheckpointInfo, cfg: RunConfig, world_size: int) -> None:
    saved_ws, saved_micro = info.meta["world_size"], info.meta["micro_steps"]
    if saved_ws != world_size:
        raise CheckpointError(f"--resume {info.path}: saved on {saved_ws} rank(s), running on "
                              f"{world_size}; the optimizer shards load on the same world size")
    micro = micro_steps_per_rank(cfg.data.slices_per_step, world_size)
    if saved_micro != micro:
        raise CheckpointError(f"--resume {info.path}: saved with {saved_micro} micro-step(s) per "
                              f"rank, this run has {micro}: another global batch; resume with the "
                              f"same settings")
    if info.meta.get("preset") not in (None, cfg.preset):
        raise CheckpointError(f"--resume {info.path}: written by preset {info.meta['preset']!r}, this "
                              f"run is {cfg.preset!r}; pass --preset {info.meta['preset']}")


def _default_run_id(cfg: RunConfig, ctx: DistributedContext) -> str:
    """`<preset>-<timestamp>` chosen on rank 0 (ranks may start a second apart), made unique."""
    ids = [None]
    if ctx.is_main:
        base = f"{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_id, n = base, 1
        while (cfg.train.runs_dir / run_id).exists():
            n += 1
            run_id = f"{base}-{n}"
        ids = [run_id]
    if ctx.world_size > 1:
        dist.broadcast_object_list(ids, src=0, group=ctx.health_group)
    return ids[0]


def _run_dir(cfg: RunConfig, ctx: DistributedContext, resume: CheckpointInfo | None) -> tuple[Path, bool]:
    if cfg.train.run_id is not None:
        run_dir = cfg.train.runs_dir / cfg.train.run_id
    elif resume is not None:
        run_dir = resume.path.parent
    else:
        return cfg.train.runs_dir / _default_run_id(cfg, ctx), False
    in_place = resume is not None and run_dir.resolve() == resume.path.parent.resolve()
    # whether an existing dir may be used is run_dir.claim_run_dir's call (rank 0, under its lock)
    return run_dir, in_place


def preflight(cfg: RunConfig, ctx: DistributedContext) -> Preflight:
    """Every check of the module docstring; raises DataError, CheckpointError or PreflightError."""
    if cfg.data.micro_steps is not None:  # --micro-steps: the global batch follows the ranks
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(
            cfg.data, slices_per_step=cfg.data.micro_steps * ctx.world_size))
    elif cfg.data.slices_per_step % ctx.world_size:
        raise PreflightError(f"{ctx.world_size} ranks do not divide the global batch of "
                             f"{cfg.data.slices_per_step} slices; run on 1, 2, 4 or 8 GPUs, or set "
                             f"--micro-steps")
    shards = check_shards(cfg.data.data_dir)
    _check_validation(cfg, shards, ctx.world_size)
    cfg, capacity = _resolve_capacity(cfg, shards)
    resume = None
    if cfg.train.resume is not None:
        resume = resolve_resume(cfg.train.resume)
        _check_resume(resume, cfg, ctx.world_size)
    _check_steps(cfg, resume.steps_done if resume else 0)
    run_dir, in_place = _run_dir(cfg, ctx, resume)
    return Preflight(cfg=cfg, run_dir=run_dir, resume=resume, resume_in_place=in_place,
                     shards=shards, capacity=capacity)
