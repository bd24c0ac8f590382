"""Presets and the command line: one dataclass tree per run, validated when built.

What it replaces: the speedrun's module-level `args` / `Hyperparameters` globals. Each component's
config lives next to its code, in a `*_config.py` module that imports no runtime (GPTConfig in
model/gpt_config.py with NgramConfig and Fp8Config beside it, ScheduleConfig in schedule.py,
AnvilConfig in optim/anvil_config.py, StepGraphsConfig in perf/cuda_graphs/graphs_config.py); this
module only nests them into `RunConfig`, defines the three presets and maps CLI flags onto them,
and imports no runtime module either (tests/test_layering.py). The resolved config is written
into the run's summary and log.

Presets:
  speedrun   the four stages of DESIGN section 3 (1285 steps, per-rank shapes of 8 ranks; on fewer
             GPUs each rank runs 8/world_size micro-steps), graphs on, compiled, bf16 matmuls
             (--fp8: the lm head and the MLP projections in fp8 on H100/H200; off by default
             until its speed and loss are measured on the speedrun)
  small-gpu  the same stages and keys with fewer steps, so it finishes on one H200 in minutes
  cpu-tiny   a 6-layer d=128 model with the real GPT-2 vocab on the embedded corpus, eager, two
             stages (one window change), one slice per step, for CPU-only machines and CI
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from track_1_short.model.fp8_config import quack_fp8_sites
from track_1_short.model.gpt_config import BACKENDS, GPTConfig
from track_1_short.optim.anvil_config import AnvilConfig
from track_1_short.perf.blas_config import BLAS_SETTINGS
from track_1_short.perf.cuda_graphs.graphs_config import GRAPH_MODES, StepGraphsConfig
from track_1_short.schedule import SPEEDRUN_STAGES, Schedule, ScheduleConfig, StageConfig

PRESETS = ("speedrun", "small-gpu", "cpu-tiny")
OPTIMIZERS = ("anvil", "adamw")
MLP_KERNELS = ("torch", "quack")  # TrainConfig.mlp_kernel
QK_NORM_ROPES = ("torch", "triton")  # TrainConfig.qk_norm_rope
EMBED_GRADS = ("pull", "dense")  # TrainConfig.embed_grad
# TrainConfig's switches of inductor options for the training forward: field -> option name
INDUCTOR_OPTIONS = {"max_autotune": "max_autotune",
                    "coordinate_descent_tuning": "coordinate_descent_tuning",
                    "inductor_pdl": "triton.enable_pdl"}
NGRAM_ACCUMULATES = ("auto", "index_add", "vector_atomic", "sorted")  # TrainConfig.ngram_accumulate (perf/ngram_store.py)
FUSED_LOSS_SCHEDULES = ("auto", "two_pass", "one_pass", "recompute")  # TrainConfig.fused_loss_schedule
MAX_PROFILE_STEPS = 20  # --profile-steps window limit
# --model-profile NAME: a named set of model fields (as --set items), applied after the other
# flags and before --set, which can override any of them; config.json holds the result, not the
# name, so a run with the profile and one with the same fields by --set are one configuration.
#   default  the preset's model
#   record   the public record's architecture (modded-nanogpt HEAD as built here): attention
#            output projections drawn like V, dense decayed Adam on a bigram-only n-gram table,
#            layers 8-10 attending over norm(h_7), MUDD gates, DC and connections. Needs the
#            11-layer model (speedrun, small-gpu). With the record's fp8 as well (--fp8 --set
#            model.fp8.mlp_backward=bf16) its val loss matched the record's on the same tokens,
#            within +0.02 at every point before the data repeat over nine runs of ours and five
#            of the record (docs/results/loss_parity_embedded-large_head_mudd_fo_fp8_pooled_2026-12-02.json);
#            it cost ~9% per step at stage C before two of DC's kernels were rewritten (not timed
#            since; fast_head_mudd against fast in docs/results/step_variants_h200_2026-12-02_C.json).
#            Each field is one ablation of scripts/gpu/loss_variants.sh (tests/test_gpu_scripts.py).
#            Without trigrams the trigram rows are dead (never read, zero through every event:
#            tests/test_ngram_table.py), so the profile keeps 8 of them (the reserved row, and a
#            table of 377,288 rows that 2, 4 and 8 ranks divide) instead of 377,280: the dense
#            event then sweeps half the rows and state, and the table and its state take ~4.6 GB
#            less (the parity runs of 2026-12-02 kept the full half: the same arithmetic on every
#            bigram row, bitwise equal on the CPU).
MODEL_PROFILES: dict[str, tuple[str, ...]] = {
    "default": (),
    "record": ("model.attn_out_init=uniform", "model.ngram.update=dense",
               "model.ngram.weight_decay=0.025", "model.ngram.trigram=false",
               "model.ngram.trigram_rows=8", "model.attn_input_layer=7",
               "model.mudd.gates=true", "model.mudd.dc=true", "model.mudd.connections=true"),
}


@dataclass(slots=True, kw_only=True)
class DataConfig:
    """Concern: where the tokens come from and how they are batched (shards, global batch,
    validation size and capacity)."""

    data_dir: Path = Path("data/embedded")  # *_train_*.bin / *_val_*.bin shards (prepare.py)
    seed: int = 0  # document order per epoch
    shuffle: bool = True  # seeded document order per epoch (False: file order, like the record)
    slices_per_step: int = 8  # global batch = this many per-rank slices (the speedrun's 8 ranks)
    # --micro-steps N: slices per rank per step; the global batch becomes N x world size slices
    # (resolved at start, trainer/preflight.py). None: slices_per_step / world size
    micro_steps: int | None = None
    val_tokens: int = 10_485_760  # validation uses at most this many tokens (FineWeb: the first 10.49M)
    val_tokens_per_batch: int = 32_768  # per rank per eval forward
    # cu_seqlens length of a validation batch; None: sized from the validation tokens at start
    val_cu_seqlens_rows: int | None = None

    def __post_init__(self):
        if self.slices_per_step < 1:
            raise ValueError(f"DataConfig.slices_per_step={self.slices_per_step} must be >= 1")
        if self.micro_steps is not None and self.micro_steps < 1:
            raise ValueError(f"--micro-steps {self.micro_steps}: must be >= 1")
        if self.val_tokens_per_batch < 128:
            raise ValueError(f"--val-tokens-per-batch {self.val_tokens_per_batch}: must be >= 128")
        if self.val_tokens < self.val_tokens_per_batch + 1:
            raise ValueError(f"--val-tokens {self.val_tokens}: smaller than one validation batch "
                             f"(--val-tokens-per-batch {self.val_tokens_per_batch} tokens + 1 target); "
                             f"raise --val-tokens or lower --val-tokens-per-batch")


@dataclass(slots=True, kw_only=True)
class TrainConfig:
    """Concern: how this run is executed and recorded (device, compile, optimizer choice, steps,
    checkpoints, run dir, profiling); nothing here changes the model's math."""

    seed: int = 1337  # model init (identical on every rank)
    device: str = "auto"  # auto: cuda if available, else cpu
    compile: bool = True  # torch.compile(fullgraph=True, dynamic=False) the model
    compile_backend: str = "inductor"  # torch.compile backend ("aot_eager": CPU tests of the graph path)
    # inductor's max_autotune for the training forward + backward: GEMMs benchmarked against
    # Triton templates, pointwise epilogues (ReLU^2 and its derivative) fused into the winners;
    # longer compiles (off until measured: scripts/gpu/fp8_step.sh's `autotune` variant)
    max_autotune: bool = False
    # inductor's coordinate_descent_tuning for the training forward + backward: each generated
    # Triton kernel's block sizes and warps benchmarked around its heuristic config at compile
    # (the rms-norm, rotary and pointwise kernels); off: on the H200 one stage-C key had not
    # finished compiling with it after 211 s, against 115 s for a whole bench run without
    # (docs/results/vs_record_h200_2026-12-03_lease15/call1), so four keys would break the
    # warmup budget; its effect on kernel time is not measured
    coordinate_descent_tuning: bool = False
    # inductor's programmatic dependent launch (its triton.enable_pdl) for the training forward +
    # backward: on Hopper each generated Triton kernel may launch while the kernel before it
    # drains and waits for its data in-kernel, which shortens the ~1 us gap at each of the
    # ~6,000 kernel boundaries per stage-C step (idle 0.9-1.0% of the step on the H200,
    # docs/results/vs_record_h200_2026-12-03_lease15). Off: measured slower, 1.019x of the
    # stage-C step and 1.030x of its kernel time (some reductions twice as long;
    # docs/results/ngram_vector_atomic_h200_2026-12-03/call1)
    inductor_pdl: bool = False
    # Portable compile cache (torch.compiler mega-cache): loaded before the first compile when the
    # file exists, rewritten (atomically) after warmup, where every graph of the run compiles.
    # None: inductor's on-disk cache only.
    compile_cache: Path | None = None
    # Compile, capture and self-check every key (and validation window), then exit before the timed
    # run: fills the compile caches, so a following run on the same machine starts warm.
    warmup_only: bool = False
    optimizer: str = "anvil"  # anvil: AnvilAndAdam; adamw: torch.optim.AdamW (baseline)
    adamw_lr: float = 3e-3
    max_steps: int | None = None  # stop after this many steps (default: the whole schedule)
    log_every: int = 10
    save_every: int = 0  # checkpoint every N steps (0: only at the end when --save-final)
    save_final: bool = True
    validation: bool = True  # False: no validation at all (benchmarks of the step: bench/step.py)
    # the fused lm-head + softcapped CE kernel (kernels/softcap_ce.py) on CUDA with a bf16 lm head
    fused_loss: bool = True
    # that kernel's schedule (kernels/softcap_ce.py): "two_pass" (the row read twice, the whole
    # gradient written), "one_pass" (read once, the gradient written up to a row scale, "One
    # pass"), "recompute" (fp8 lm head only: the forward writes no gradient, the backward
    # recomputes it as it quantises it, kernels/fp8_logit_grad.py), or "auto": recompute with an
    # fp8 lm head (timed in the step, docs/results/vs_record_h200_2026-12-03.json), two_pass with
    # a bf16 one (one_pass is faster alone but not yet timed in the step)
    fused_loss_schedule: str = "auto"
    # on one rank, the n-gram row pull and the held gradient's sum run inside the step runner's
    # forward and backward (captured into the step graphs; perf/ngram_store.py "Rows inside the
    # step"); False: around them, eagerly, as with several ranks (where the pull is a collective)
    ngram_rows_in_step: bool = True
    # how the n-gram hold sums a micro-step's sink gradient into the row accumulator
    # (perf/ngram_store.py, NgramStore's accumulate): "auto" (vector_atomic on CUDA, index_add
    # elsewhere; the run prints which), "index_add" (index_add_, a float32 atomic per element),
    # "vector_atomic" (CUDA: the same sum with four columns per atomic, kernels/row_accumulate.py;
    # 0.45x index_add_'s time at stage C on the H200) or "sorted" (CUDA: a sort of the row ids and
    # one add per distinct row, deterministic; the same module: 1.6x index_add_'s time at C)
    ngram_accumulate: str = "auto"
    # the training forward's MLP: "torch" (two GEMMs and ReLU^2 as elementwise kernels, inductor's
    # fusions) or "quack" (quack-kernels' GEMMs with ReLU^2 and its derivative in the epilogues,
    # kernels/relu2_mlp.py; CUDA SM90 / SM100; with fp8 on mlp_up its up projection is fp8, with
    # model.fp8.mlp_backward "bf16"; not with fp8 on mlp_down)
    mlp_kernel: str = "torch"
    # q/k rms-norm + RoPE of every attention layer: "torch" (the model's code, inductor's
    # kernels) or "triton" (kernels/qk_norm_rope.py: one pass each way, writing the attention's
    # layout; CUDA; 0.969x of the stage-C step on the H200 against a torch path that had
    # regressed since, so not yet the default)
    qk_norm_rope: str = "torch"
    # the token embedding's gradient: "pull" (its backward adds the micro-step's rows into one
    # persistent float32 buffer, GPT.embed_grad_accum, which Adam reads on its steps and zeroes:
    # no dense [V, D] gradient and no accumulator add per micro-step, as for the value
    # embeddings) or "dense" (autograd's embedding backward, a [V, D] gradient per micro-step
    # summed by the step runner's accumulator)
    embed_grad: str = "pull"
    # the process's cuBLAS setting (perf/blas.py, applied before the first CUDA call):
    # "default" (torch's own), or one without cuBLAS's workspace and/or through cuBLASLt, whose
    # GEMMs may then be captured without the memset before each (bench/gemm_memsets.py measures
    # which does and at what GEMM cost)
    blas: str = "default"
    resume: Path | None = None  # a checkpoint folder, or a run dir (its newest complete checkpoint)
    runs_dir: Path = Path("runs")
    run_id: str | None = None  # default: <preset>-<timestamp>; an existing run dir is refused
    overwrite: bool = False  # an existing run dir of this run id is emptied and reused
    timeout_s: float = 600.0  # collective timeout: a dead rank becomes an error naming it
    # torch.use_deterministic_algorithms for the run (train.deterministic_mode): run-to-run
    # reproducible kernels where torch has them (a warning names each op that has none); slower
    deterministic: bool = False
    # --profile-steps START:END: torch.profiler over timed steps [START, END) on rank 0
    # (perf/profiling.py: a chrome trace and profile.json in the run dir; the summary's "profile")
    profile_steps: tuple[int, int] | None = None
    # --update-norms START:END: per parameter, the RMS of each timed step's update and of the
    # value after it, for the steps in [START, END) (trainer/update_norms.py; metrics lines of
    # kind "update_norms"; a copy of the parameters and one sync per probed step)
    update_norm_steps: tuple[int, int] | None = None

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer={self.optimizer!r}: one of {OPTIMIZERS}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"--device={self.device!r}: one of auto, cuda, cpu")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps={self.max_steps} must be >= 1")
        if self.profile_steps is not None:
            start, end = self.profile_steps
            if not 0 <= start < end or end - start > MAX_PROFILE_STEPS:
                raise ValueError(f"--profile-steps {start}:{end}: needs 0 <= START < END and at most "
                                 f"{MAX_PROFILE_STEPS} steps (a trace of more is too large to read)")
        if self.update_norm_steps is not None and not 0 <= self.update_norm_steps[0] < self.update_norm_steps[1]:
            start, end = self.update_norm_steps
            raise ValueError(f"--update-norms {start}:{end}: needs 0 <= START < END")
        if self.compile_cache is not None and not self.compile:
            raise ValueError(f"--compile-cache {self.compile_cache}: needs the compiled model "
                             f"(drop --no-compile)")
        if self.ngram_accumulate not in NGRAM_ACCUMULATES:
            raise ValueError(f"train.ngram_accumulate={self.ngram_accumulate!r}: one of "
                             f"{NGRAM_ACCUMULATES}")
        if self.mlp_kernel not in MLP_KERNELS:
            raise ValueError(f"--mlp-kernel={self.mlp_kernel!r}: one of {MLP_KERNELS}")
        if self.qk_norm_rope not in QK_NORM_ROPES:
            raise ValueError(f"train.qk_norm_rope={self.qk_norm_rope!r}: one of {QK_NORM_ROPES}")
        if self.blas not in BLAS_SETTINGS:
            raise ValueError(f"train.blas={self.blas!r}: one of {tuple(BLAS_SETTINGS)}")
        if self.blas != "default" and self.deterministic:
            raise ValueError(f"train.blas={self.blas} with --deterministic: deterministic mode needs "
                             f"cuBLAS's workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8); drop one of them")
        if self.embed_grad not in EMBED_GRADS:
            raise ValueError(f"train.embed_grad={self.embed_grad!r}: one of {EMBED_GRADS}")
        if self.fused_loss_schedule not in FUSED_LOSS_SCHEDULES:
            raise ValueError(f"train.fused_loss_schedule={self.fused_loss_schedule!r}: one of "
                             f"{FUSED_LOSS_SCHEDULES}")
        if self.fused_loss_schedule not in ("auto", "two_pass") and not self.fused_loss:
            raise ValueError(f"train.fused_loss_schedule={self.fused_loss_schedule} is a schedule of "
                             f"the fused loss: drop --no-fused-loss, or the schedule setting")
        for name in INDUCTOR_OPTIONS:
            if getattr(self, name) and (not self.compile or self.compile_backend != "inductor"):
                raise ValueError(f"TrainConfig.{name} needs the compiled model with the inductor "
                                 f"backend (compile={self.compile}, compile_backend="
                                 f"{self.compile_backend!r})")
        if self.warmup_only and not self.compile:
            raise ValueError("--warmup-only: an uncompiled model has nothing to warm up (drop "
                             "--no-compile)")
        if self.warmup_only and self.resume is not None:
            raise ValueError("--warmup-only with --resume: a warmup-only run trains no step; drop one")
        if self.save_every < 0 or self.log_every < 1:
            raise ValueError("--save-every must be >= 0 and --log-every >= 1")
        if self.run_id is not None and (not self.run_id or "/" in self.run_id or
                                        self.run_id in (".", "..")):
            raise ValueError(f"--run-id {self.run_id!r}: must be a plain folder name (no '/')")


@dataclass(slots=True, kw_only=True)
class RunConfig:
    """Concern: the whole run's configuration tree (one per run), validated across its parts
    when built; written to the run dir as config.json."""

    preset: str
    model: GPTConfig
    schedule: ScheduleConfig
    optim: AnvilConfig
    graphs: StepGraphsConfig
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    needs_cuda: bool = False  # a GPU preset: refused up front on a machine without CUDA

    @property
    def checkpoint_period(self) -> int:
        """Steps between the boundaries where nothing is held across (checkpoint.aligned): the
        schedule's (an Adam step that is also an n-gram update event, StepPlan.nothing_held)."""
        return Schedule(self.schedule).checkpoint_period

    def __post_init__(self):
        if self.graphs.mode != "off" and not self.train.compile:
            raise ValueError("--graphs on/check needs the compiled model (drop --no-compile or "
                             "pass --graphs off)")
        largest = max(s.tokens_per_rank for s in self.schedule.stages)
        if self.model.max_position < max(2 * largest, self.data.val_tokens_per_batch):
            raise ValueError(f"model.max_position={self.model.max_position} must cover 2x the "
                             f"largest step ({largest} tokens, paired heads double positions) and "
                             f"--val-tokens-per-batch={self.data.val_tokens_per_batch}")
        if self.train.mlp_kernel == "quack":
            fp8 = self.model.fp8
            refusal = fp8.fused_mlp_refusal(quack_fp8_sites(fp8.fp8_mlp_sites()))
            if refusal is not None:
                raise ValueError(f"--mlp-kernel quack {refusal}")
        fp8 = self.model.fp8
        if self.train.fused_loss_schedule == "recompute" and not (fp8.enabled and "lm_head" in fp8.sites):
            raise ValueError("train.fused_loss_schedule=recompute is the fp8 lm head's (its backward "
                             "recomputes the gradient as it quantises it): add --fp8 with lm_head "
                             "in model.fp8.sites, or take train.fused_loss_schedule=one_pass")
        if self.train.optimizer == "adamw" and self.optim.polar_gemms != "torch":
            raise ValueError("optim.polar_gemms=quack is ANVIL's Polar Express; --optimizer adamw "
                             "has none: drop it or take --optimizer anvil")
        if self.train.optimizer == "adamw" and self.schedule.adam_every != 1:
            raise ValueError(f"--optimizer adamw updates every step: ScheduleConfig.adam_every must "
                             f"be 1, got {self.schedule.adam_every} (from_args sets it)")
        period = self.checkpoint_period
        if self.train.save_every % period:
            lower = self.train.save_every // period * period
            hint = f"--save-every {lower} or {lower + period}" if lower else f"--save-every {period}"
            raise ValueError(f"--save-every {self.train.save_every}: checkpoints can only be taken "
                             f"every {period} steps (after an Adam step and an n-gram update event, "
                             f"where nothing is held across the step boundary); use {hint}")
        if self.model.ngram.cache_rows < 2 * max(largest, self.data.val_tokens_per_batch):
            raise ValueError(f"model.ngram.cache_rows={self.model.ngram.cache_rows} must hold 2 rows "
                             f"per token of the largest batch")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _scaled_stages(steps: tuple[int, ...]) -> tuple[StageConfig, ...]:
    return tuple(dataclasses.replace(stage, num_steps=n) for stage, n in zip(SPEEDRUN_STAGES, steps))


def _tiny_stages() -> tuple[StageConfig, ...]:
    common = dict(prefix_weight_end=0.0, mtp_weights_end=(1.0, 0.0))
    return (
        StageConfig(name="A", num_steps=120, tokens_per_rank=512, ws_short=128, ws_long=256,
                    max_seq_len=256, mtp_weights_start=(1.0, 0.5), prefix_weight_start=0.25,
                    lr_mul=1.0, **common),
        StageConfig(name="B", num_steps=80, tokens_per_rank=512, ws_short=128, ws_long=384,
                    max_seq_len=512, mtp_weights_start=(1.0, 0.0), prefix_weight_start=0.0,
                    lr_mul=1.0, **common),
    )


def preset(name: str) -> RunConfig:
    """The named preset's RunConfig (before CLI overrides)."""
    if name == "speedrun":
        return RunConfig(preset=name, model=GPTConfig(), schedule=ScheduleConfig(),
                         optim=AnvilConfig(), graphs=StepGraphsConfig(), needs_cuda=True)
    if name == "small-gpu":
        stages = _scaled_stages((60, 60, 60, 8))
        return RunConfig(preset=name, model=GPTConfig(),
                         schedule=ScheduleConfig(stages=stages, momentum_warmup_steps=40,
                                                 momentum_cooldown_steps=10, val_every_steps=60),
                         optim=AnvilConfig(),
                         graphs=StepGraphsConfig(), needs_cuda=True)
    if name == "cpu-tiny":
        stages = _tiny_stages()
        return RunConfig(preset=name, model=GPTConfig.tiny(),
                         schedule=ScheduleConfig(stages=stages, momentum_warmup_steps=50,
                                                 momentum_cooldown_steps=20, val_every_steps=50,
                                                 final_val_ws_long=512),
                         optim=AnvilConfig(),
                         graphs=StepGraphsConfig(mode="off"),
                         data=DataConfig(slices_per_step=1, val_tokens=16_384,
                                         val_tokens_per_batch=2048),
                         train=TrainConfig(compile=False, device="cpu", log_every=10))
    raise ValueError(f"unknown preset {name!r}: one of {PRESETS}")


def _int_at_least(low: int):
    """argparse type: an int >= low (argparse names the flag in its exit-2 message)."""
    def parse_int(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse_int


def _by_preset(read) -> str:
    """'speedrun X, small-gpu Y, cpu-tiny Z': a setting's default in each preset, for --help."""
    values = {name: read(preset(name)) for name in PRESETS}
    if len(set(map(str, values.values()))) == 1:
        return f"default {next(iter(values.values()))}"
    return "default " + ", ".join(f"{name} {value}" for name, value in values.items())


def _add_run_flags(add) -> None:
    """Checkpoints, resume and run dirs (README: runs, checkpoints and stopping)."""
    add("--save-every", type=_int_at_least(0),
        help="checkpoint every N steps, a multiple of the Adam / n-gram cadence "
             f"({_by_preset(lambda c: c.checkpoint_period)[8:]}); default 0: only the final checkpoint")
    add("--no-save-final", action="store_true", help="skip the final checkpoint")
    add("--resume", type=Path,
        help="continue exactly from a checkpoint folder, or from the newest complete checkpoint "
             "of a run dir; the run continues in that run dir unless --run-id names another")
    add("--runs-dir", type=Path, help="where run dirs go (default runs/)")
    add("--run-id", help="run dir name (default <preset>-<timestamp>); an existing one is refused "
                         "unless --overwrite or --resume")
    add("--overwrite", action="store_true",
        help="empty an existing run dir of this --run-id and start it clean")


def _add_speed_flags(add) -> None:
    """How the step runs: compile, fp8, the fused loss, compile caches, attention backend."""
    add("--compile", action=argparse.BooleanOptionalAction, default=None,
        help=f"torch.compile the model ({_by_preset(lambda c: c.train.compile)})")
    add("--fp8", action=argparse.BooleanOptionalAction, default=None,
        help=f"fp8 lm head / MLP matmuls on CUDA ({_by_preset(lambda c: c.model.fp8.enabled)})")
    add("--fused-loss", action=argparse.BooleanOptionalAction, default=None,
        help="the fused lm-head + softcapped CE Triton kernel on CUDA (bf16 lm head; "
             "--no-fused-loss: the torch loss); default on")
    add("--compile-cache", type=Path,
        help="portable compile-cache file: loaded if present, written after warmup (lets a fresh "
             "machine skip most of the compile); default none")
    add("--warmup-only", action="store_true",
        help="compile, capture and self-check every key, write warmup.json, exit (fills the "
             "compile caches for a following run on the same machine)")
    add("--mlp-kernel", choices=MLP_KERNELS,
        help="the training forward's MLP: torch (default) or quack (fused ReLU^2 epilogues, "
             "quack-kernels on CUDA SM90/SM100)")
    add("--attention", choices=BACKENDS,
        help="attention backend (default auto: flex on CUDA, reference on CPU; logged)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m track_1_short.train",
                                usage="%(prog)s [--preset NAME] [options] (--help lists them)",
                                description="GPT-2-small speedrun trainer (CUDA-graph training step)")
    add = p.add_argument
    add("--preset", choices=PRESETS, default="cpu-tiny",
        help="speedrun (8-GPU record schedule), small-gpu (same keys, fewer steps), cpu-tiny (CPU "
             "smoke run); default cpu-tiny (./run.sh passes speedrun on a GPU machine)")
    add("--data-dir", type=Path, help=f"shard dir ({_by_preset(lambda c: c.data.data_dir)})")
    add("--graphs", choices=GRAPH_MODES,
        help="on: CUDA-graph step; off: compiled model launched eagerly; check: graphs plus sampled "
             f"self-checks during the timed run ({_by_preset(lambda c: c.graphs.mode)})")
    add("--check-fraction", type=float,
        help=f"--graphs check: share of steps checked ({_by_preset(lambda c: c.graphs.check_fraction)})")
    _add_speed_flags(add)
    add("--model-profile", choices=tuple(MODEL_PROFILES), default="default",
        help="default: the preset's model; record: the public record's architecture (MUDD "
             "gates, DC and connections, a bigram-only n-gram table with dense Adam, ...: "
             "config.py's MODEL_PROFILES; the 11-layer presets only), applied before --set")
    add("--optimizer", choices=OPTIMIZERS, help="anvil (default) or adamw (baseline)")
    add("--seed", type=int, help=f"model init seed ({_by_preset(lambda c: c.train.seed)})")
    add("--data-seed", type=int, help=f"document order seed ({_by_preset(lambda c: c.data.seed)})")
    add("--max-steps", type=_int_at_least(1),
        help="stop after this many steps (default the whole schedule: "
             f"{_by_preset(lambda c: sum(s.num_steps for s in c.schedule.stages))[8:]})")
    add("--val-every", type=_int_at_least(1),
        help=f"validate every N steps and at the end ({_by_preset(lambda c: c.schedule.val_every_steps)})")
    add("--val-tokens", type=_int_at_least(2),
        help=f"use at most this many validation tokens ({_by_preset(lambda c: c.data.val_tokens)})")
    add("--val-tokens-per-batch", type=_int_at_least(128),
        help=f"validation tokens per rank per forward "
             f"({_by_preset(lambda c: c.data.val_tokens_per_batch)})")
    add("--micro-steps", type=_int_at_least(1),
        help="micro-steps per rank per step (default 8 / world size: the speedrun's global batch "
             "on any GPU count); with another value the global batch is N x world size slices, "
             "e.g. --micro-steps 1 on one GPU runs one rank's step of the 8-GPU run")
    add("--doc-capacity", type=_int_at_least(1),
        help="most documents in one micro-batch of any stage and in one validation batch (the "
             "graphs bake it); default: sized from the data at start (the most any batch of the "
             "stage can hold in these shards), logged")
    _add_run_flags(add)
    add("--device", choices=("auto", "cuda", "cpu"),
        help=f"device ({_by_preset(lambda c: c.train.device)}; auto: cuda if available)")
    add("--profile-steps", type=_step_range, metavar="START:END",
        help="torch.profiler over timed steps [START, END) (rank 0): chrome trace and profile.json "
             "(kernel time, busy time, top kernels) in the run dir")
    add("--update-norms", type=_step_range, metavar="START:END",
        help="per parameter (and the n-gram table), the RMS of each timed step's update and of "
             "its value, for steps [START, END): metrics lines of kind update_norms (a diagnostic "
             "for loss runs: a parameter copy and a host sync per probed step)")
    add("--deterministic", action="store_true",
        help="deterministic kernels where torch has them (reproducible runs for debugging and "
             "tests; slower); ops without one warn, naming the op")
    add("--log-every", type=_int_at_least(1),
        help=f"train-loss log cadence in steps ({_by_preset(lambda c: c.train.log_every)})")
    add("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="set any scalar field of the config tree, after every other flag, e.g. --set "
             "model.attn_out_init=uniform --set optim.lr=0.02 (repeatable; bool true/false, "
             "'none' for an optional field, comma-separated tuples, e.g. model.fp8.sites="
             "mlp_up,mlp_down); the run's config.json "
             "records the result")
    return p


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _parse_field(text: str, hint, key: str):
    """VALUE of --set KEY=VALUE as the field's declared type (ValueError naming KEY otherwise)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        if text.lower() == "none":
            return None
        (hint,) = [a for a in args if a is not type(None)]  # X | None
        args = typing.get_args(hint)
    try:
        if hint is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError
            return text.lower() in _TRUE
        if hint in (int, float, str, Path):
            return hint(text)
        if typing.get_origin(hint) is tuple and args[1:] == (Ellipsis,) and args[0] in (int, float, str):
            return tuple(args[0](x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--set {key}={text}: not a valid {getattr(hint, '__name__', hint)}") from None
    if dataclasses.is_dataclass(hint):
        raise ValueError(f"--set {key}: a section ({hint.__name__}), not a field: set one of its "
                         f"fields, {key}.FIELD=VALUE")
    raise ValueError(f"--set {key}: a field of type {hint} cannot be set from the command line")


def _apply_set(cfg: RunConfig, item: str) -> None:
    """--set SECTION.FIELD=VALUE on the config tree (a scalar field of a nested dataclass)."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. model.attn_out_init=uniform")
    obj, names = cfg, key.split(".")
    for i, name in enumerate(names):
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        if name not in fields:
            where = ".".join(names[:i]) or "the run config"
            raise ValueError(f"--set {key}: {where} has no field {name!r}"
                             + (f" (fields: {', '.join(sorted(fields))})" if fields else ""))
        if i < len(names) - 1:
            obj = getattr(obj, name)
    hint = typing.get_type_hints(type(obj))[names[-1]]
    setattr(obj, names[-1], _parse_field(text.strip(), hint, key))


def with_sets(cfg: RunConfig, items: list[str]) -> RunConfig:
    """cfg with every --set item applied (_apply_set), then the whole tree re-validated
    (_validate_tree): a bad item or value is a ValueError naming it."""
    for item in items:
        _apply_set(cfg, item)
    _validate_tree(cfg)
    return cfg


def with_profile_and_sets(cfg: RunConfig, profile: str, items: list[str]) -> RunConfig:
    """cfg with MODEL_PROFILES[profile]'s fields, then the --set items, applied, and the tree
    validated once (so a --set can settle what the profile alone would not), for the trainer's
    and the bench's --model-profile and --set. A ValueError names the item or value; one that
    only the profile brings (the same flags without it pass) also names the profile and the
    preset."""
    if profile not in MODEL_PROFILES:
        raise ValueError(f"--model-profile {profile!r}: one of {', '.join(MODEL_PROFILES)}")
    fields = list(MODEL_PROFILES[profile])
    if not fields:
        return with_sets(cfg, items)
    without = copy.deepcopy(cfg)
    try:
        return with_sets(cfg, fields + items)
    except ValueError as e:
        with_sets(without, items)  # raises the flags' own error if they fail without the profile
        raise ValueError(f"--model-profile {profile} on preset {cfg.preset}: {e}") from None


def _validate_tree(obj) -> None:
    """Re-run __post_init__ on every dataclass of the tree, leaves first."""
    for f in dataclasses.fields(obj):
        child = getattr(obj, f.name)
        if dataclasses.is_dataclass(child) and not isinstance(child, type):
            _validate_tree(child)
    post = getattr(obj, "__post_init__", None)
    if post is not None:
        post()


def _step_range(text: str) -> tuple[int, int]:
    """'START:END' -> (START, END) for --profile-steps and --update-norms."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(start), int(end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected START:END, e.g. 130:132") from None


def _set(obj, name: str, value) -> None:
    if value is not None:
        setattr(obj, name, value)


def from_args(args: argparse.Namespace) -> RunConfig:
    """Apply CLI overrides to the preset and re-validate the whole tree (ValueError names the flag)."""
    cfg = preset(args.preset)
    _set(cfg.data, "data_dir", args.data_dir)
    _set(cfg.data, "seed", args.data_seed)
    _set(cfg.data, "val_tokens", args.val_tokens)
    _set(cfg.data, "val_tokens_per_batch", args.val_tokens_per_batch)
    _set(cfg.data, "micro_steps", args.micro_steps)
    _set(cfg.graphs, "mode", args.graphs)
    _set(cfg.graphs, "check_fraction", args.check_fraction)
    _set(cfg.train, "compile", args.compile)
    _set(cfg.train, "compile_cache", args.compile_cache)
    _set(cfg.train, "fused_loss", args.fused_loss)
    _set(cfg.train, "mlp_kernel", args.mlp_kernel)
    _set(cfg.train, "optimizer", args.optimizer)
    if cfg.train.optimizer == "adamw":  # AdamW updates every step (optim/adamw_baseline.py)
        cfg.schedule.adam_every = 1
    _set(cfg.train, "seed", args.seed)
    _set(cfg.train, "max_steps", args.max_steps)
    _set(cfg.train, "save_every", args.save_every)
    _set(cfg.train, "resume", args.resume)
    _set(cfg.train, "runs_dir", args.runs_dir)
    _set(cfg.train, "run_id", args.run_id)
    _set(cfg.train, "device", args.device)
    _set(cfg.train, "log_every", args.log_every)
    _set(cfg.train, "profile_steps", args.profile_steps)
    _set(cfg.train, "update_norm_steps", args.update_norms)
    _set(cfg.schedule, "val_every_steps", args.val_every)
    _set(cfg.model, "attention_backend", args.attention)
    _set(cfg.model.fp8, "enabled", args.fp8)
    if args.doc_capacity is not None:  # cu_seqlens rows: one per document, plus the leading 0
        rows = args.doc_capacity + 1
        cfg.schedule.stages = tuple(dataclasses.replace(s, cu_seqlens_rows=rows)
                                    for s in cfg.schedule.stages)
        cfg.data.val_cu_seqlens_rows = rows
    for flag, obj, name in ((args.warmup_only, cfg.train, "warmup_only"),
                            (args.deterministic, cfg.train, "deterministic"),
                            (args.overwrite, cfg.train, "overwrite")):
        if flag:
            setattr(obj, name, True)
    if args.no_save_final:
        cfg.train.save_final = False
    # the model profile, then --set; then every __post_init__ on the edited tree: a bad value
    # fails, naming it
    return with_profile_and_sets(cfg, args.model_profile, args.set)


def parse(argv: list[str] | None = None) -> RunConfig:
    """CLI -> RunConfig; bad flags or values exit with code 2 and a message naming them."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return from_args(args)
    except ValueError as e:
        parser.error(str(e))  # exits 2
    raise AssertionError("unreachable")


if __name__ == "__main__":
    print(parse(sys.argv[1:]))
