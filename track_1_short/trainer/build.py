"""Building a run: the spec from the config, the model, and every systems concern applied to it in
one ordered place (`prepare_model`).

What it replaces: a `build()` that cast parameters, resolved the attention backend and fp8,
sharded the n-gram table, built the optimizer, compiled and made the step runner in one
50-line body mixed with data and bookkeeping, so the order the concerns depend on was implicit.

prepare_model's order, and why (torchtitan's parallelize_* plays this role):
  1. bf16 casts (CUDA): the optimizer's fp32 masters and the graphs must see the final dtypes;
  2. attention backend: a per-device choice the compiled forward specializes on;
  3. the training forward's strategies installed: fp8 matmuls (--fp8, model/fp8.Fp8Matmuls: they
     need the device, add scale buffers the graphs bake), then the fused ReLU^2 MLP inside
     whichever matmul strategy is installed (--mlp-kernel quack, kernels/relu2_mlp.py; with
     fp8 on the lm head alone both run), the q/k norm + RoPE kernel (train.qk_norm_rope=triton,
     kernels/qk_norm_rope.py; eval uses it too), and the fused lm-head loss kernel (CUDA; between fp8 GEMMs
     when the lm head is an fp8 site; --no-fused-loss keeps the torch loss): all change what
     compile traces;
  4. the n-gram store built around the model's lookup (perf/ngram_store.py: the table, its
     sparse Adam, held gradients, the row pull into the lookup's cache) and sharded (several
     ranks): before the optimizer and any capture or census, as both bake the table's shard;
  5. optimizer: reads the final parameters (dtype, sharding) for its masters and state, takes
     value_embeds' gradient buffer (and the token embedding's, TrainConfig.embed_grad "pull")
     and Polar Express's GEMMs (optim.polar_gemms=quack: kernels/polar_gemms.py); wrapped in OptimizerGraphs (its device half captured
     per cadence, perf/cuda_graphs/optimizer_graphs.py) with --graphs on, on one rank;
  6. compile: wraps the model as it now is (every later change would be a recompile);
  7. step runner (CUDA graphs or the eager twin): wraps the compiled model and hands gradients
     to the optimizer's parameters; the row prefetch wraps the sharded table. On one rank (with
     TrainConfig.ngram_rows_in_step) the runner also pulls and holds the n-gram rows inside its
     forward and backward (ngram_rows_in_step below), so both get the store; with
     TrainConfig.embed_grad "pull" its forward passes GPT.embed_grad_accum as the embedding's
     gradient buffer (the one step 5 gave the optimizer).

Call order: lifecycle.py: make_spec -> build_model -> prepare_model -> build_run (data, metrics).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from track_1_short.config import INDUCTOR_OPTIONS, RunConfig, TrainConfig
from track_1_short.data import SliceShape, load_val_tokens, make_train_loader
from track_1_short.distributed import DistributedContext
from track_1_short.model.fp8 import Fp8Matmuls
from track_1_short.model.fp8_config import quack_fp8_sites
from track_1_short.model.gpt import GPT, ForwardScheduleConfig
from track_1_short.model.loss import build_prefix_table
from track_1_short.optim.adamw_baseline import AdamWBaseline
from track_1_short.optim.anvil import AnvilAndAdam
from track_1_short.optim.anvil_config import build_param_cfgs
from track_1_short.optim.polar_express import TORCH_PE_GEMMS, PolarGemms
from track_1_short.perf.cuda_graphs.capture_plan import step_keys
from track_1_short.perf.cuda_graphs.grad_handoff import loss_scale
from track_1_short.perf.cuda_graphs.optimizer_graphs import OptimizerGraphsConfig, make_optimizer_graphs
from track_1_short.perf.cuda_graphs.step_graphs import make_step_runner
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.perf.row_prefetch import LookaheadLoader, RowPrefetch
from track_1_short.report import MetricsLog
from track_1_short.schedule import Schedule, StepPlan
from track_1_short.tokenizer import mergeable_ranks
from track_1_short.trainer.state import Optimizer, Progress, Run, RunLog, RunSpec, StepParts
from track_1_short.trainer.stop import GracefulStop
from track_1_short.trainer.timing import StepTimer, SyncCounter

BF16_PARAMS = ("embed.weight", "lm_head", "qk_bank", "vo_bank", "mlp_bank", "value_embeds.weight")
# Every key and each validation window is a recompile of the same code; past dynamo's default
# limit (8) it would silently run eager. HEAD uses 64.
RECOMPILE_LIMIT = 64


def forward_configs(plans: list[StepPlan], device: torch.device) -> tuple[ForwardScheduleConfig, ...]:
    """Per-step ForwardScheduleConfig with its tensors made once (no per-step host-to-device copy)."""
    return tuple(ForwardScheduleConfig(
        mtp_weights=torch.tensor(plan.mtp_weights, dtype=torch.float32, device=device),
        prefix_weight=torch.tensor(plan.prefix_weight, dtype=torch.float32, device=device),
        ws_short=plan.ws_short, ws_long=plan.ws_long,
        train_max_seq_len=plan.max_seq_len) for plan in plans)


def untie_step(cfg: RunConfig, schedule: Schedule) -> int | None:
    """The schedule's untie step (Schedule.untie_step); None for the AdamW baseline, whose embed
    and lm_head are separate parameters from the start."""
    return None if cfg.train.optimizer == "adamw" else schedule.untie_step


def make_spec(cfg: RunConfig, ctx: DistributedContext, run_dir) -> RunSpec:
    schedule = Schedule(cfg.schedule)
    num_steps = min(schedule.num_steps, cfg.train.max_steps or schedule.num_steps)
    plans = [schedule.plan(step) for step in range(num_steps)]
    return RunSpec(cfg=cfg, ctx=ctx, schedule=schedule, num_steps=num_steps, plans=tuple(plans),
                   fwd_cfgs=forward_configs(plans, ctx.device),
                   untie_step=untie_step(cfg, schedule), run_dir=run_dir)


def build_model(cfg: RunConfig, device: torch.device) -> GPT:
    """The single-device model, seeded, on its device (no systems concern applied yet)."""
    torch.manual_seed(cfg.train.seed)
    return GPT(cfg.model).to(device)


def build_optimizer(cfg: RunConfig, model: GPT, ctx: DistributedContext) -> Optimizer:
    if cfg.train.optimizer == "adamw":
        if ctx.world_size > 1:
            raise ValueError("--optimizer adamw is a single-process baseline; use anvil with torchrun")
        opt = AdamWBaseline(model.named_parameters(), lr=cfg.train.adamw_lr)
    else:
        opt = AnvilAndAdam(build_param_cfgs(model.named_parameters()), cfg.optim,
                           tied_embed_head=(model.embed.weight, model.lm_head),
                           names={p: n for n, p in model.named_parameters()},
                           polar_gemms=resolve_polar_gemms(cfg.optim.polar_gemms, ctx.device))
    opt.set_grad_buffer(model.value_embeds.weight, model.value_embeds.grad_accum)
    embed_grad = embed_grad_buffer(cfg.train, model)
    if embed_grad is not None:
        opt.set_grad_buffer(model.embed.weight, embed_grad)
    return opt


def resolve_polar_gemms(name: str, device: torch.device) -> PolarGemms:
    """AnvilConfig.polar_gemms as the strategy AnvilAndAdam passes to Polar Express: torch's
    bmm / baddbmm, or "quack" (kernels/polar_gemms.py: gemm_symmetric / gemm_add, no copy of the
    C operand), an error naming the reason where quack cannot run (asked for explicitly: no
    silent fallback to torch's GEMMs)."""
    if name == "torch":
        return TORCH_PE_GEMMS
    from track_1_short.kernels import polar_gemms

    reason = polar_gemms.polar_express_unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"optim.polar_gemms=quack cannot run on {device}: {reason}; use "
                         f"optim.polar_gemms=torch")
    return polar_gemms.QUACK_PE_GEMMS


def embed_grad_buffer(train: TrainConfig, model: GPT) -> Tensor | None:
    """The token embedding's pulled-gradient buffer (TrainConfig.embed_grad "pull"), or None for
    its dense .grad: the one buffer the optimizer reads and the step runner's forward adds into."""
    return model.embed_grad_accum if train.embed_grad == "pull" else None


def _install_fp8(model: GPT, device: torch.device, grad_scale: float) -> None:
    """--fp8: Fp8Matmuls as the training forward's matmul strategy, where it can run (where it
    cannot, Fp8Matmuls.resolve warns naming the device and the reason, and bf16 stays);
    grad_scale: the loss's gradient scale (1 / micro-steps), for the lm head's e5m2 scale."""
    if not model.config.fp8.enabled:
        return
    fp8 = Fp8Matmuls(model.config.fp8, num_layers=model.config.num_layers,
                     grad_scale=grad_scale).to(device)
    if fp8.resolve(device):
        model.matmuls = fp8


def _install_mlp_kernel(model: GPT, device: torch.device, kernel: str) -> None:
    """TrainConfig.mlp_kernel="quack": the fused ReLU^2 MLP (kernels/relu2_mlp.py) inside the
    training forward's installed matmul strategy (plain or fp8: the lm head keeps its own
    matmul, e.g. fp8 with model.fp8.sites=lm_head; with "mlp_up" among the active fp8 sites the
    fused MLP's up projection is fp8); an error naming the reason where it cannot run (asked for
    explicitly: no silent fallback to the torch MLP)."""
    if kernel == "torch":
        return
    from track_1_short.kernels import relu2_mlp

    reason = relu2_mlp.quack_unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"--mlp-kernel quack cannot run on {device}: {reason}")
    fp8_sites = quack_fp8_sites(_fp8_sites(model))
    if fp8_sites == ("mlp_up",):  # the fp8 up projection (the config: with a bf16 MLP backward)
        model.matmuls.use_fused_mlp(relu2_mlp.quack_relu2_mlp_fp8_up, relu2_mlp.QUACK_MLP_FP8_UP_LABEL,
                                    fp8_sites=fp8_sites)
    else:
        model.matmuls.use_fused_mlp(relu2_mlp.quack_relu2_mlp, relu2_mlp.QUACK_MLP_LABEL)


def _install_qk_norm_rope(model: GPT, device: torch.device, kernel: str) -> None:
    """TrainConfig.qk_norm_rope="triton": q/k rms-norm + RoPE in one Triton pass each way
    (kernels/qk_norm_rope.py) for every attention layer, training and eval; CUDA only (asked for
    explicitly: an error on another device, no silent fallback to the torch path)."""
    if kernel == "torch":
        return
    if device.type != "cuda":
        raise ValueError(f"train.qk_norm_rope=triton runs a CUDA kernel, this model is on {device}; "
                         f"use train.qk_norm_rope=torch")
    from track_1_short.kernels.qk_norm_rope import qk_norm_rope

    model.qk_norm_rope = qk_norm_rope


def _fp8_sites(model: GPT) -> tuple[str, ...]:
    """The call sites the training forward runs in fp8 (none without an active Fp8Matmuls)."""
    return model.config.fp8.sites if isinstance(model.matmuls, Fp8Matmuls) else ()


def _install_fused_loss(model: GPT, device: torch.device, enabled: bool,
                        schedule: str = "auto") -> None:
    """The fused lm-head + softcapped CE kernel as the training forward's head loss, on CUDA: with
    bf16 GEMMs (kernels/softcap_ce.py), or with `lm_head` among the active fp8 sites its fp8
    GEMMs around the same kernel (kernels/softcap_ce_fp8.py, the lm head's static scale buffers
    of GPT.matmuls); schedule: the kernel's (TrainConfig.fused_loss_schedule; "auto": recompute
    with the fp8 head, two_pass with the bf16 one; an explicit "recompute" needs the fp8 head:
    ValueError naming the setting when fp8 did not install on this device)."""
    if not (enabled and device.type == "cuda"):
        return
    from track_1_short.kernels.softcap_ce import default_launch  # Triton: CUDA hosts only
    fp8_head = "lm_head" in _fp8_sites(model)
    if schedule == "auto":
        schedule = "recompute" if fp8_head else "two_pass"
    launch = default_launch(schedule)
    if launch.recompute and not fp8_head:
        raise ValueError("train.fused_loss_schedule=recompute needs the fp8 lm head, which is not "
                         "active on this device (see the fp8 warning above): take "
                         "train.fused_loss_schedule=one_pass")
    if fp8_head:
        from track_1_short.kernels.softcap_ce_fp8 import linear_softcap_ce_fp8
        model.head_loss = functools.partial(linear_softcap_ce_fp8, x_s=model.matmuls.lm_head_x_scale,
                                            w_s=model.matmuls.lm_head_w_scale,
                                            grad_s=model.matmuls.lm_head_grad_scale, launch=launch)
    else:
        from track_1_short.kernels.softcap_ce import linear_softcap_ce
        model.head_loss = functools.partial(linear_softcap_ce, launch=launch)


def compile_model(model: GPT, train: TrainConfig):
    """(training forward, eval_ce): torch.compile(fullgraph=True, dynamic=False) of each with
    TrainConfig.compile (the training forward with the inductor options its switches ask for,
    config.INDUCTOR_OPTIONS), else the model itself and its eval_ce."""
    if not train.compile:
        return model, model.eval_ce
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    options = {option: True for field, option in INDUCTOR_OPTIONS.items()
               if getattr(train, field)} or None
    forward_fn = torch.compile(model, fullgraph=True, dynamic=False, backend=train.compile_backend,
                               options=options)
    eval_fn = torch.compile(model.eval_ce, fullgraph=True, dynamic=False, backend=train.compile_backend)
    return forward_fn, eval_fn


def describe_strategies(model: GPT) -> str:
    """One log line: which matmuls and which loss the training forward runs."""
    sites = _fp8_sites(model)
    matmuls = f"fp8 ({', '.join(sites)}), otherwise bf16/fp32" if sites else "bf16/fp32"
    if model.matmuls.mlp_label:
        matmuls += f" (the MLP: {model.matmuls.mlp_label})"
    if model.head_loss is None:
        loss = "torch (model/loss.py)"
    else:
        loss = ("fused Triton kernel between fp8 GEMMs (kernels/softcap_ce_fp8.py)" if "lm_head" in sites
                else "fused Triton kernel (kernels/softcap_ce.py)")
        launch = getattr(model.head_loss, "keywords", {}).get("launch")
        if launch is not None and launch.recompute:
            loss += " in one pass, the gradient recomputed in the backward (kernels/fp8_logit_grad.py)"
        elif launch is not None and launch.one_pass:
            loss += " in one pass"
    qk = "; q/k norm + RoPE: one Triton kernel (kernels/qk_norm_rope.py)" if model.qk_norm_rope else ""
    return f"training forward: {matmuls} matmuls, {loss} loss{qk}"


def prepare_for_device(model: GPT, device: torch.device, fused_loss: bool = True,
                       mlp_kernel: str = "torch", grad_scale: float = 1.0,
                       fused_loss_schedule: str = "auto", qk_norm_rope: str = "torch") -> GPT:
    """Steps 1-3 of the module docstring: what one device needs (the benches stop here).
    grad_scale: the training loss's gradient scale (1 / micro-steps; fp8's lm-head scale)."""
    if device.type == "cuda":  # bf16 matrices (fp32 masters live in the optimizer)
        for name, p in model.named_parameters():
            if name in BF16_PARAMS:
                p.data = p.data.to(torch.bfloat16)
    model.resolve_attention_backend(device)
    _install_fp8(model, device, grad_scale)
    _install_mlp_kernel(model, device, mlp_kernel)
    _install_qk_norm_rope(model, device, qk_norm_rope)
    _install_fused_loss(model, device, fused_loss, fused_loss_schedule)
    return model


def prepare_model(model: GPT, spec: RunSpec, graph_backend=None) -> StepParts:
    """Every systems concern applied to the model, in the module docstring's order.
    graph_backend: None for CUDA graphs; the CPU stand-in (capture_support.RecordingGraphBackend)
    lets tests run the whole graph path (capture, self-check, census, seal) without a GPU."""
    cfg, ctx, device = spec.cfg, spec.ctx, spec.ctx.device
    prepare_for_device(model, device, cfg.train.fused_loss, cfg.train.mlp_kernel,
                       grad_scale=loss_scale(spec.micro_steps),
                       fused_loss_schedule=cfg.train.fused_loss_schedule,
                       qk_norm_rope=cfg.train.qk_norm_rope)  # 1.-3.
    # 4. the table behind the model's lookup (its cache); holds one sink gradient per micro-step
    # until the schedule's event
    ngram = NgramStore(model.ngram_table, cycle=cfg.schedule.ngram_cycle,
                       micro_steps=spec.micro_steps, accumulate=cfg.train.ngram_accumulate)
    if ctx.world_size > 1:
        ngram.shard(ctx.rank, ctx.world_size)
    optimizer = make_optimizer_graphs(  # 5. (its step captured per cadence with --graphs on)
        build_optimizer(cfg, model, ctx),
        OptimizerGraphsConfig(mode=cfg.graphs.mode, check_fraction=cfg.graphs.check_fraction,
                              seed=cfg.graphs.seed,
                              # one micro-step: p.grad is the step graph's own buffer (per key)
                              grad_inputs="adopt" if spec.micro_steps > 1 else "stage"),
        plans=spec.plans, untie_step=spec.untie_step, backend=graph_backend, device=device)
    forward_fn, eval_fn = compile_model(model, cfg.train)  # 6.
    keys = step_keys(spec.schedule, num_steps=spec.num_steps)  # 7.
    in_step = ngram_rows_in_step(cfg.train, ngram)
    runner = make_step_runner(cfg.graphs, model=forward_fn, optimizer=optimizer, step_keys=keys,
                              ngram_table=model.ngram_table, value_embeds=model.value_embeds,
                              max_step_tokens=max(k.tokens for k in keys), plans=spec.plans,
                              micro_steps=spec.micro_steps, device=device, backend=graph_backend,
                              ngram_store=ngram if in_step else None,
                              embed_grad=embed_grad_buffer(cfg.train, model))
    prefix = build_prefix_table(mergeable_ranks(), cfg.model.vocab_size).to(device)
    return StepParts(model=model, forward_fn=forward_fn, eval_fn=eval_fn, optimizer=optimizer,
                     runner=runner, ngram=ngram, prefetch=RowPrefetch(ngram, rows_in_step=in_step),
                     prefix_table=prefix)


def ngram_rows_in_step(train: TrainConfig, ngram: NgramStore) -> bool:
    """Whether the step runner pulls and holds the n-gram rows (TrainConfig.ngram_rows_in_step on
    one rank; with several the pull is a collective and stays around the step)."""
    return train.ngram_rows_in_step and ngram.rows_in_step


def describe_ngram_rows(parts: StepParts) -> str:
    """One log line: where the n-gram rows are pulled and held, and what sums the held gradients
    (train.ngram_accumulate as resolved on this device)."""
    summed = f"; held gradients summed by {parts.ngram.accumulate} (train.ngram_accumulate)"
    if parts.prefetch.rows_in_step:
        return ("n-gram rows: pulled and held inside the step (one rank; in the step graphs with "
                f"--graphs on){summed}")
    why = (f"{parts.ngram.world_size} ranks: the pull is a collective" if not parts.ngram.rows_in_step
           else "train.ngram_rows_in_step=false")
    return f"n-gram rows: pulled and held around the step, eagerly ({why}){summed}"


def build_run(spec: RunSpec, stop: GracefulStop, graph_backend=None) -> Run:
    """The run's parts: model prepared, validation tokens loaded, metrics and timer ready."""
    cfg, ctx = spec.cfg, spec.ctx
    parts = prepare_model(build_model(cfg, ctx.device), spec, graph_backend)
    log = RunLog(metrics=MetricsLog(spec.run_dir, enabled=ctx.is_main), timer=StepTimer(ctx.device),
                 syncs=SyncCounter(ctx.device))
    return Run(spec=spec, parts=parts, progress=Progress(), log=log,
               val_tokens=load_val_tokens(cfg.data.data_dir, cfg.data.val_tokens), stop=stop)


def make_loader(spec: RunSpec, state: dict | None = None, seed_offset: int = 0,
                steps: list[int] | None = None) -> LookaheadLoader:
    """The training loader; warmup uses another seed so the timed run starts on unseen order.
    `steps`: the schedule steps the loader's consecutive steps stand for (the warmup visit plan,
    which jumps between stages), so each batch has the shape of the step that consumes it."""
    sched, cfg, ctx = spec.schedule, spec.cfg, spec.ctx
    shapes = [SliceShape(s.tokens_per_rank, s.max_seq_len, s.cu_seqlens_rows) for s in cfg.schedule.stages]
    largest = SliceShape(max(s.tokens for s in shapes), max(s.max_seq_len for s in shapes),
                         max(s.cu_seqlens_rows for s in shapes))

    def shape_for_step(step: int) -> SliceShape:
        if steps is not None:
            step = steps[min(step, len(steps) - 1)]
        return shapes[sched.stage_index(min(step, sched.num_steps - 1))]

    return LookaheadLoader(make_train_loader(
        cfg.data.data_dir, shape_for_step, ctx.rank, ctx.world_size, ctx.device,
        seed=cfg.data.seed + seed_offset, max_shape=largest, shuffle=cfg.data.shuffle, state=state,
        slices_per_step=cfg.data.slices_per_step))
