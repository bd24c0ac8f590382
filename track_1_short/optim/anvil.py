"""AnvilAndAdam: the trainer's optimizer. ANVIL (orthogonalised updates) on the matrix banks, Adam on
everything else, both sharded across ranks.

What it replaces: modded-nanogpt's 575-line `NorMuonAndAdam` (HEAD f411b3d3, `train_gpt.py:349-947`),
split here by concern: anvil_config.py (ParamConfig, the name table, AnvilConfig),
anvil_math.py (the per-shard update math, checked against float64 references), polar_express.py
(orthogonalisation and its coefficients) and this file (sharding, comm order, state). Why it is
fast: every rank orthogonalises only its 1/W slice of each bank (reduce_scatter -> update ->
all_gather instead of all_reduce + redundant work), Adam runs every other step on two steps'
gradients (odd steps are ~4-7 ms slower than even ones in the record log, facts 6), and the
collectives are launched asynchronously in an order that overlaps them with the update math.

ANVIL (cfg.optim == "anvil"): a bank is [N, R, C] or [N, S, R, C], seen as M = N*S matrices; M must
be a multiple of the world size W (the model pads M: GPTConfig.bank_pad_multiple). Per step:
reduce_scatter(AVG) of p.grad so rank r owns matrices [r*K, (r+1)*K), K = M/W; Nesterov momentum
(fp32); Polar Express; NorMuon normalisation; cautious weight decay with lr_eff = lr * lr_mul *
slot_lr_mul * sqrt(max(1, R/C)); all_gather back into the bank. Adam (cfg.optim == "adam"): on Adam
steps only (the caller's `adam_step`, the schedule's StepPlan.adam_step), on p.grad summed since the
last Adam step (two steps in the speedrun); "all_reduce" params are updated whole on every rank,
"sharded" ones by dim-0 row blocks of Dp = ceil(D0/W) rows (padded buffers when W does not divide D0).

Per-step call order (trainer/step.py): backward (p.grad set; ANVIL banks may hold the step graph's
own gradient buffer, which the reduce-scatter here reads before the next replay rewrites it) ->
`step(step, lr_scale, momentum, adam_step)` -> nothing else. The optimizer derives no cadence: the
momentum and whether Adam updates come from the schedule's StepPlan (plan.momentum,
plan.adam_step), passed by the caller. step() is `write_step_values(lr_scale, momentum,
adam_step)` (host: this step's momentum, lrs, Adam step sizes into the StepValues tensor, one H2D
copy, no sync; advances the Adam step count on Adam steps) -> `run_step(step, adam_step)` (device
work only: reads every per-step value through that tensor, no host sync, no .item(), no branch on
device values, allocates no persistent memory; its Python inputs are the cadence (adam_step) and
the tie state, so a CUDA graph per cadence can capture it; `step` only names failures) ->
`zero_grad(adam_step)`, which drops ANVIL grads every step and Adam grads only after an Adam step,
so between Adam steps the next backward (GradHandoff's persistent accumulator, which adds unless
the plan opens a window: StepPlan.adam_first) adds into the kept .grad.
value_embeds (and embed with TrainConfig.embed_grad "pull"): its gradient never reaches p.grad;
`set_grad_buffer(param, buffer)` makes step() read that buffer instead and zero it in place after
the Adam update (or, for the tied embed, lm_head's gradient) consumed it.
Tied embed/lm_head (`tied_embed_head=(embed, lm_head)`, lm_head stored [d, V]): while tied, on Adam
steps embed.grad.T is added into lm_head's gradient, only lm_head is updated, and embed <- lm_head.T.
Call `untie_embed_head()` once, right after step() of the split step (the first step of stage C,
made odd), to move lm_head's Adam state, transposed, into embed's.

Step phases and comm overlap (facts 4.2 "Ordering"; `run_step()` below):
1. launch every reduction: bank reduce-scatters first (largest, and their consumers do the most math),
   then the Adam reductions in work order;
2. Adam updates in work order: the small replicated params ("all_reduce" in PARAM_TABLE) in one
   adam_group_step_ call, then the tables ("sharded") largest first, lm_head before embed (embed's
   copy waits on lm_head's gather), one fused adam_step_ each; each update's math overlaps the bank
   reduce-scatters still in flight, each sharded table's all_gather launches as soon as it is updated;
3. bank updates (the heaviest math, Polar Express) overlap the Adam all_gathers; each bank's
   all_gather launches when its shard is done;
4. wait the gathers (lm_head first, so embed <- lm_head.T copies while the rest finish).
The step graphs are not involved: optimizer kernels and collectives run on the current stream.

Compiled (AnvilConfig.compile; on by default for CUDA parameters): anvil_math's five step
functions are wrapped in torch.compile(dynamic=False, fullgraph=True). Per-step values are inputs
(StepValues), so the graphs are one per bank shard shape (3), one per table (embed, lm_head,
value_embeds), one for the small-parameter group and, while tied, the gradient fold and the
weight copy, compiled at the first even and first Adam step (embed's at the first Adam step after
the untie) and never again: within dynamo's default recompile_limit (8 per function), whatever
the caller sets. Off on CPU by default: inductor's C++
build costs ~10 s per graph on the 2-core test machine, more than the cpu-tiny run spends in the
optimizer.

Precision: the update math runs in fp32 on a per-shard fp32 MASTER copy whenever the parameter is not
fp32 (bf16 on GPU): the master is updated, then rounded into the bank/table shard that is gathered.
The record instead keeps a uint16 "mantissa" beside the bf16 value (same precision, 2 B/elt less);
the master costs 4 B per OWNED element (1/W of each table). Masters are re-read from the parameters
by reset() and __init__, so load model weights, then reset() or load_state_dict().

What must stay address-stable: every state buffer (momentum, second moment, masters, Adam moments,
reduce-scatter outputs, padded buffers, the StepValues tensor) is allocated in __init__ and only
ever written in place: reset(), load_state_dict() and untie_embed_head() copy, never rebind
(named_state_tensors() lists them for an address census).

State dict (each rank saves ITS shards; format STATE_FORMAT): {"format", "rank", "world_size",
"adam_steps", "tied", "banks": {name: {"first_matrix", "momentum", "second_moment"[, "master"]}},
"adam": {name: {"first_row", "sharded", "exp_avg", "exp_avg_sq"[, "master"]}}}. A bank tensor is
rows [first_matrix, first_matrix + K) along dim 0 of the bank's [M, R, C] view; a sharded Adam
tensor is rows [first_row, first_row + Dp) of the dim-0-padded [Dp*W, ...] table; replicated ones
are whole. Checkpoint after an Adam (odd) step: the .grad an even step keeps for the next Adam
step is not optimizer state. To use torch.distributed.checkpoint, wrap each sharded tensor as a DTensor with
Shard(0) over the padded global shape. Loading requires the same world size and rank.

Polar Express's GEMMs (`polar_gemms`, a PolarGemms strategy whose name must equal
AnvilConfig.polar_gemms): torch's by default; trainer/build.py passes quack's
(kernels/polar_gemms.py) for `optim.polar_gemms=quack`, so this package never imports kernels/.

Provenance: facts sections 3 and 4 (modded-nanogpt records through #342, NorMuon PR, Polar
Express PR #253, cautious weight decay PR #172). Deviations: fp32 master instead of the mantissa
buffer; no sparse bigram comms (n-gram rows are NgramStore's update); no Triton XXT kernels
(quack's gemm_symmetric / gemm_add with optim.polar_gemms=quack).

Legend: W world size, M matrices in a bank view, K = M/W owned matrices, R rows, C cols,
D0 a sharded table's dim 0, Dp = ceil(D0/W) owned rows, S per-step values, NG grouped Adam params.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from track_1_short.optim import anvil_math
from track_1_short.optim.anvil_config import (ADAM, ALL_REDUCE, ANVIL, PARAM_TABLE, SHARDED,
                                              AnvilConfig, ParamConfig, build_param_cfgs)
from track_1_short.optim.polar_express import (POLAR_EXPRESS_COEFFS, TORCH_PE_GEMMS, PolarGemms,
                                               derive_coefficients)
from track_1_short.optim.step_values import StepValues

__all__ = ["AnvilAndAdam", "AnvilConfig", "ParamConfig", "PARAM_TABLE", "build_param_cfgs",
           "STATE_FORMAT"]

STATE_FORMAT = "track_1_short.anvil_and_adam/1"
AVG = dist.ReduceOp.AVG
ANVIL_VALUES = 3  # StepValues [0:3]: momentum mu, lr, weight_decay * lr (anvil_math.anvil_bank_step_)
ADAM_VALUES = 4  # per Adam parameter: beta1, beta2, step_size, eff_wd (anvil_math.adam_step_)
# torch 2.13 deprecates reduce_scatter_tensor for reduce_scatter_single (same signature); the H200
# image runs torch 2.11, which only has the former.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(slots=True, eq=False)
class BankShard:
    """One ANVIL bank: this rank's matrices [first, first + K) of view [M, R, C]."""

    param: nn.Parameter
    name: str
    view: Tensor  # [M, R, C], a view of param.data
    first: int
    grad: Tensor | None  # [K, R, C] reduce-scatter output; None when W == 1 (p.grad is read directly)
    momentum: Tensor  # [K, R, C] fp32
    second_moment: Tensor  # [K, R, 1] (R >= C) or [K, 1, C] fp32
    master: Tensor | None  # [K, R, C] fp32, when the bank is not fp32
    lr_mul: Tensor  # [K, 1, 1] fp32: lr_mul * slot lr_mul * sqrt(max(1, R/C))
    ortho_dtype: torch.dtype  # Polar Express iterates in this dtype

    @property
    def shard(self) -> Tensor:
        return self.view[self.first:self.first + self.momentum.size(0)]  # [K, R, C]


@dataclass(slots=True, eq=False)
class AdamShard:
    """One Adam parameter: whole (replicated) or rows [first, first + Dp) of the padded table."""

    param: nn.Parameter
    name: str
    cfg: ParamConfig
    sharded: bool  # cfg.comm == "sharded" and W > 1
    first: int  # first owned row (0 when replicated)
    real_rows: int  # owned rows that exist in the parameter (the rest is padding)
    grad_in: Tensor | None  # [Dp*W, ...] zero-padded gradient copy (sharded, W does not divide D0)
    grad: Tensor | None  # [Dp, ...] reduce-scatter output (sharded)
    gathered: Tensor | None  # [Dp*W, ...] padded all_gather target (sharded, padded)
    exp_avg: Tensor  # fp32, shard shape
    exp_avg_sq: Tensor
    master: Tensor | None  # fp32 shard, when the parameter is not fp32
    hyper: Tensor | None = None  # [4] view of StepValues: beta1, beta2, step_size, eff_wd (set in __init__)

    @property
    def target(self) -> Tensor:
        """The tensor this rank's update is written into and (sharded) gathered over."""
        return self.gathered if self.gathered is not None else self.param.data

    @property
    def shard(self) -> Tensor:
        return self.target[self.first:self.first + self.exp_avg.size(0)] if self.sharded else self.target


class AnvilAndAdam:
    """Concern: the optimizer's state and its step (sharding, comm order, the update math it
    calls); see the module docstring. Built once by trainer/build.py, after the model is on its
    device."""

    def __init__(self, param_cfgs: dict[nn.Parameter, ParamConfig], cfg: AnvilConfig,
                 process_group=None, *, names: dict[nn.Parameter, str] | None = None,
                 tied_embed_head: tuple[nn.Parameter, nn.Parameter] | None = None,
                 polar_gemms: PolarGemms = TORCH_PE_GEMMS):
        if polar_gemms.name != cfg.polar_gemms:
            # the config is what the run log records: it must name the GEMMs that run
            raise ValueError(f"optim.polar_gemms={cfg.polar_gemms!r} but the {polar_gemms.name!r} "
                             "Polar Express GEMMs were passed: trainer/build.py resolves the "
                             "strategy from the config (kernels/polar_gemms.QUACK_PE_GEMMS for quack)")
        self.param_cfgs = param_cfgs
        self.cfg = cfg
        self.polar_gemms = polar_gemms
        self.group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        names = names or {p: f"param{i}" for i, p in enumerate(param_cfgs)}
        device = next(iter(param_cfgs)).device
        self.coeffs = POLAR_EXPRESS_COEFFS if cfg.ns_steps == len(POLAR_EXPRESS_COEFFS) \
            else tuple(derive_coefficients(cfg.ns_steps))
        self.compiled = cfg.compile if cfg.compile is not None else device.type == "cuda"
        wrap = (lambda f: torch.compile(f, dynamic=False, fullgraph=True, backend=cfg.compile_backend)) \
            if self.compiled else (lambda f: f)
        self._bank_step, self._adam_step, self._adam_group_step = (
            wrap(anvil_math.anvil_bank_step_), wrap(anvil_math.adam_step_),
            wrap(anvil_math.adam_group_step_))
        self._fold_tied_grad, self._copy_transposed = (wrap(anvil_math.fold_tied_grad_),
                                                       wrap(anvil_math.copy_transposed_))
        self.banks = [self._bank(p, names[p], c) for p, c in param_cfgs.items() if c.optim == ANVIL]
        adam = [self._adam(p, names[p], c) for p, c in param_cfgs.items() if c.optim == ADAM]
        self.adam_by_param = {a.param: a for a in adam}
        self.tied_initial = None
        if tied_embed_head is not None:
            embed, head = (self.adam_by_param[p] for p in tied_embed_head)
            if tuple(embed.param.shape) != tuple(head.param.shape)[::-1]:
                raise ValueError(f"tied_embed_head: embed {tuple(embed.param.shape)} must be lm_head "
                                 f"{tuple(head.param.shape)} transposed")
            self.tied_initial = (embed, head)
        # Phase 2 work order: the small replicated group first, then the tables largest first (their
        # gathers are the longest), lm_head ahead of embed (stable sort keeps construction order).
        head = self.tied_initial[1] if self.tied_initial else None
        self.adam_group = [a for a in adam if a.cfg.comm == ALL_REDUCE]
        self.adam_tables = sorted((a for a in adam if a.cfg.comm != ALL_REDUCE),
                                  key=lambda a: (-a.param.numel(), a is not head))
        self.step_values = StepValues(ANVIL_VALUES + ADAM_VALUES * len(adam), device)
        values = self.step_values.values
        self._anvil_values = values[:ANVIL_VALUES]  # [3]
        adam_values = values[ANVIL_VALUES:].view(len(adam), ADAM_VALUES)  # [NG + tables, 4]
        self._group_hypers = adam_values[:len(self.adam_group)]  # [NG, 4]
        for a, hyper in zip(self.adam_group + self.adam_tables, adam_values):
            a.hyper = hyper
        self.grad_buffers: dict[nn.Parameter, Tensor] = {}
        self.tied = self.tied_initial
        self.adam_steps = 0
        self.reset()

    # ---- construction ----

    def _bank(self, p: nn.Parameter, name: str, cfg: ParamConfig) -> BankShard:
        rows, cols = p.shape[-2:]
        slots = p.shape[1] if p.dim() == 4 else 1
        view = p.data.view(-1, rows, cols)  # [M, R, C]
        num_matrices = view.size(0)
        if num_matrices % self.world_size:
            raise ValueError(f"{name}: {num_matrices} matrices do not split over {self.world_size} "
                             "ranks; pad the bank's matrix count to a multiple of the world size "
                             "(GPTConfig.bank_pad_multiple)")
        if cfg.slot_lr_muls and len(cfg.slot_lr_muls) != slots:
            raise ValueError(f"{name}: slot_lr_muls has {len(cfg.slot_lr_muls)} entries for {slots} slots")
        k = num_matrices // self.world_size
        first = self.rank * k
        slot_muls = cfg.slot_lr_muls or (1.0,)
        lr_mul = torch.tensor([slot_muls[(first + i) % len(slot_muls)] for i in range(k)],
                              dtype=torch.float32, device=p.device).view(k, 1, 1)
        lr_mul *= cfg.lr_mul * math.sqrt(max(1.0, rows / cols))
        f32 = dict(dtype=torch.float32, device=p.device)
        moment_shape = (k, rows, 1) if anvil_math.reduced_dim(rows, cols) == -1 else (k, 1, cols)
        return BankShard(
            param=p, name=name, view=view, first=first,
            grad=torch.zeros(k, rows, cols, dtype=p.dtype, device=p.device) if self.world_size > 1 else None,
            momentum=torch.zeros(k, rows, cols, **f32), second_moment=torch.zeros(moment_shape, **f32),
            master=torch.zeros(k, rows, cols, **f32) if p.dtype != torch.float32 else None,
            lr_mul=lr_mul, ortho_dtype=self._ortho_dtype(p))

    def _adam(self, p: nn.Parameter, name: str, cfg: ParamConfig) -> AdamShard:
        sharded = cfg.comm == SHARDED and self.world_size > 1
        if sharded and not p.is_contiguous():
            # NCCL's all_gather_into_tensor refuses strided tensors (gloo accepts them): the update
            # is gathered straight into p.data, and rebinding it here would move a baked address.
            raise ValueError(f"sharded Adam parameter {name} {tuple(p.shape)} has strides "
                             f"{p.stride()}: make it contiguous before building the optimizer "
                             f"(e.g. w.T.contiguous(), not w.T.clone())")
        d0, rest = (p.shape[0], tuple(p.shape[1:])) if p.dim() else (1, ())  # 0-d: one element
        rows = -(-d0 // self.world_size) if sharded else d0
        state_shape = (rows, *rest) if sharded else tuple(p.shape)  # replicated: exactly p's shape
        padded = sharded and rows * self.world_size != d0
        first = self.rank * rows if sharded else 0
        full = (rows * self.world_size, *rest)

        def zeros(shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, device=p.device)
        return AdamShard(
            param=p, name=name, cfg=cfg, sharded=sharded, first=first,
            real_rows=max(0, min(rows, d0 - first)),
            grad_in=zeros(full, p.dtype) if padded else None,
            grad=zeros((rows, *rest), p.dtype) if sharded else None,
            gathered=zeros(full, p.dtype) if padded else None,
            exp_avg=zeros(state_shape), exp_avg_sq=zeros(state_shape),
            master=zeros(state_shape) if p.dtype != torch.float32 else None)

    def _ortho_dtype(self, p: nn.Parameter) -> torch.dtype:
        if self.cfg.ortho_dtype == "auto":
            return torch.bfloat16 if p.is_cuda else torch.float32
        return getattr(torch, self.cfg.ortho_dtype)

    # ---- public per-step API ----

    def set_grad_buffer(self, param: nn.Parameter, buffer: Tensor):
        """Read `param`'s gradient from `buffer` (persistent, summed over the Adam interval by its
        owner) instead of param.grad; step() zeroes it in place after each Adam update. Call once at
        setup, before warmup: the reduce-scatter buffers follow the buffer's dtype (reallocated here)."""
        a = self.adam_by_param.get(param)
        if a is None or buffer.shape != param.shape:
            raise ValueError("set_grad_buffer: needs an Adam parameter and a buffer of its shape, got "
                             f"{tuple(buffer.shape)} for {a.name if a else 'a non-Adam parameter'}")
        if a.grad is not None and a.grad.dtype != buffer.dtype:
            a.grad = a.grad.to(buffer.dtype)
            a.grad_in = None if a.grad_in is None else a.grad_in.to(buffer.dtype)
        self.grad_buffers[param] = buffer

    @torch.no_grad()
    def step(self, step: int, lr_scale: float, momentum: float, adam_step: bool):
        """One optimizer step: `lr_scale` multiplies both base lrs, `momentum` is the ANVIL momentum,
        `adam_step` says whether Adam updates (the schedule's plan.lr_mul, plan.momentum,
        plan.adam_step). Host half, device half, then zero_grad; `step` only names failures."""
        self.write_step_values(lr_scale, momentum, adam_step)
        self.run_step(step, adam_step)
        self.zero_grad(adam_step)

    def write_step_values(self, lr_scale: float, momentum: float, adam_step: bool):
        """Host half of step(): this step's values (computed in double) into self.step_values, and
        the Adam step count advanced when `adam_step`, so call it exactly once per step, before
        run_step and outside any captured region (StepValues' ring slot is not address-stable)."""
        lr = self.cfg.lr * lr_scale
        values = [momentum, lr, self.cfg.weight_decay * lr]
        t = self.adam_steps + 1  # the bias corrections of the next Adam step (unused on other steps)
        for a in self.adam_group + self.adam_tables:
            beta1, beta2 = a.cfg.betas
            lr_a = self.cfg.adam_lr * lr_scale * a.cfg.lr_mul
            values += [beta1, beta2, lr_a * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t),
                       lr_a * lr_a * self.cfg.adam_weight_decay * a.cfg.wd_mul]
        self.step_values.write(values)
        if adam_step:
            self.adam_steps = t

    @torch.no_grad()
    def run_step(self, step: int, adam_step: bool):
        """Device half of step(): reductions, updates (Adam's only when `adam_step`), gathers (see
        the module docstring). Reads the per-step values only through self.step_values; `step` only
        names failures."""
        # Phase 1: launch all reductions (async); banks first, they feed the longest math.
        pending = self._launch_reductions(step, adam_step)
        # Phase 2: Adam math overlaps the bank reduce-scatters; table gathers launch as each is done.
        gathers = self._adam_phase(pending) if adam_step else []
        # Phase 3: bank math (Polar Express) overlaps the Adam gathers; bank gathers launch per bank.
        gathers += self._anvil_phase(pending)
        # Phase 4: wait, lm_head first so the tied embed copy overlaps the remaining gathers.
        self._finish(gathers, adam_step)

    def zero_grad(self, adam_step: bool):
        """Drop ANVIL grads every step and Adam grads after Adam steps only (between Adam steps
        they accumulate)."""
        for p, c in self.param_cfgs.items():
            if c.optim == ANVIL or adam_step:
                p.grad = None

    # ---- phases ----

    def _grad(self, a: AdamShard, step: int) -> Tensor:
        g = self.grad_buffers.get(a.param, a.param.grad)
        # A missing gradient on one rank would desynchronise the collectives: fail here instead.
        assert g is not None, f"step {step}: {a.name} has no gradient on an Adam step"
        return g

    def _launch_reductions(self, step: int, adam_step: bool) -> dict:
        pending = {}
        for b in self.banks:
            g = b.param.grad
            assert g is not None, f"step {step}: ANVIL bank {b.name} has no gradient"
            g = g.view(b.view.shape)  # [M, R, C]
            pending[b] = (g, None) if b.grad is None else (b.grad, _reduce_scatter(
                b.grad, g, op=AVG, group=self.group, async_op=True))
        if not adam_step:
            return pending
        if self.tied:
            embed, head = self.tied
            # a grad buffer is consumed into lm_head's and zeroed: the owner accumulates afresh
            self._fold_tied_grad(self._grad(head, step), self._grad(embed, step),
                                 embed.param in self.grad_buffers)
        for a in self.adam_group + self.adam_tables:
            if self.tied and a is self.tied[0]:
                continue
            g = self._grad(a, step)
            if not a.sharded:
                work = None if self.world_size == 1 else dist.all_reduce(
                    g, op=AVG, group=self.group, async_op=True)
                pending[a] = (g, work)
                continue
            if a.grad_in is not None:
                a.grad_in[:g.size(0)].copy_(g)  # pad rows stay zero
                g = a.grad_in
            pending[a] = (a.grad, _reduce_scatter(a.grad, g, op=AVG, group=self.group,
                                                  async_op=True))
        return pending

    def _adam_phase(self, pending: dict) -> list:
        grads = [self._wait(pending[a]) for a in self.adam_group]
        if self.adam_group:
            self._update_group(grads)
        gathers = []
        for a in self.adam_tables:
            if a not in pending:
                continue  # the tied embed: lm_head carries its gradient
            self._update_table(a, self._wait(pending[a]))
            if a.sharded:
                gathers.append((a, dist.all_gather_into_tensor(a.target, a.shard, group=self.group,
                                                               async_op=True)))
        return gathers

    @staticmethod
    def _wait(entry: tuple) -> Tensor:
        grad, work = entry
        if work is not None:
            work.wait()
        return grad

    def _update_group(self, grads: list[Tensor]):
        """The small replicated parameters: one adam_group_step_ call (one compiled graph)."""
        group = self.adam_group
        self._adam_group_step(
            [a.master if a.master is not None else a.shard for a in group], grads,
            [a.exp_avg for a in group], [a.exp_avg_sq for a in group], self._group_hypers,
            self.cfg.adam_eps, [a.shard if a.master is not None else None for a in group],
            [self.grad_buffers.get(a.param) is g for a, g in zip(group, grads)])

    def _update_table(self, a: AdamShard, grad: Tensor):
        """One table (or its shard): one adam_step_ call; the gradient buffer it consumed is zeroed
        in the same pass when the update read it directly (else here, after its reduce-scatter)."""
        buffer = self.grad_buffers.get(a.param)
        shard = a.shard
        if a.master is None and a.gathered is not None:
            # the padded buffer only mirrors the parameter: refresh this rank's real rows
            shard[:a.real_rows].copy_(a.param.data[a.first:a.first + a.real_rows])
        self._adam_step(a.master if a.master is not None else shard, grad, a.exp_avg, a.exp_avg_sq,
                        a.hyper, self.cfg.adam_eps, shard if a.master is not None else None,
                        buffer is grad)
        if buffer is not None and buffer is not grad:
            buffer.zero_()  # consumed by the reduce-scatter: the owner accumulates afresh

    def _update_bank(self, b: BankShard, grad: Tensor):
        """One bank shard: one anvil_bank_step_ call (one compiled graph per shard shape)."""
        shard = b.shard
        self._bank_step(grad, b.momentum, b.second_moment, b.master if b.master is not None else shard,
                        shard if b.master is not None else None, b.lr_mul, self._anvil_values,
                        self.cfg.beta2, b.ortho_dtype, self.coeffs, self.polar_gemms)

    def _anvil_phase(self, pending: dict) -> list:
        gathers = []
        for b in self.banks:
            self._update_bank(b, self._wait(pending[b]))
            if self.world_size > 1:
                gathers.append((b, dist.all_gather_into_tensor(b.view, b.shard, group=self.group,
                                                               async_op=True)))
        return gathers

    def _finish(self, gathers: list, adam_step: bool):
        head = self.tied[1] if self.tied and adam_step else None
        gathers.sort(key=lambda item: item[0] is not head)
        for owner, work in gathers:
            work.wait()
            if isinstance(owner, AdamShard) and owner.gathered is not None:
                owner.param.data.copy_(owner.gathered[:owner.param.size(0)])
            if owner is head:
                self._copy_transposed(self.tied[0].param.data, head.param.data)
        if head is not None and not head.sharded:
            self._copy_transposed(self.tied[0].param.data, head.param.data)

    # ---- untie, reset, state ----

    def _full_rows(self, a: AdamShard, t: Tensor) -> Tensor:
        """The whole (unpadded) tensor of which `t` is a's shard (a collective when sharded)."""
        if not a.sharded:
            return t
        out = t.new_empty((t.size(0) * self.world_size, *t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=self.group)
        return out[:a.param.size(0)]

    @torch.no_grad()
    def untie_embed_head(self):
        """Stage C split: embed's Adam state <- lm_head's, transposed (facts 3). Collective; call on
        every rank right after step() of the split step. Buffers are copied into, not replaced."""
        assert self.tied, "untie_embed_head: embed and lm_head are not tied"
        embed, head = self.tied
        pairs = [(head.exp_avg, embed.exp_avg), (head.exp_avg_sq, embed.exp_avg_sq)]
        if head.master is not None:
            pairs.append((head.master, embed.master))
        for src, dst in pairs:
            full = self._full_rows(head, src).T  # [V, d]
            dst.zero_()
            dst[:embed.real_rows].copy_(full[embed.first:embed.first + embed.real_rows])
        self.tied = None

    @torch.no_grad()
    def reset(self):
        """Restore the initial optimizer state IN PLACE (no buffer is reallocated): zero moments,
        Adam step count 0, re-tie, masters re-read from the parameters, grads dropped."""
        for b in self.banks:
            b.momentum.zero_()
            b.second_moment.zero_()
            if b.master is not None:
                b.master.copy_(b.shard)
        for a in self.adam_by_param.values():
            a.exp_avg.zero_()
            a.exp_avg_sq.zero_()
            if a.master is not None:
                a.master.zero_()
                a.master[:a.real_rows].copy_(a.param.data[a.first:a.first + a.real_rows])
        for buffer in self.grad_buffers.values():
            buffer.zero_()
        for p in self.param_cfgs:
            p.grad = None
        self.adam_steps = 0
        self.tied = self.tied_initial

    def _tensors(self):
        """(section, name, owner, {field: tensor}) of every state tensor of this rank."""
        for b in self.banks:
            fields = dict(momentum=b.momentum, second_moment=b.second_moment)
            if b.master is not None:
                fields["master"] = b.master
            yield "banks", b.name, b, fields
        for a in self.adam_by_param.values():
            fields = dict(exp_avg=a.exp_avg, exp_avg_sq=a.exp_avg_sq)
            if a.master is not None:
                fields["master"] = a.master
            yield "adam", a.name, a, fields

    def named_state_tensors(self):
        """(role, tensor) of every persistent optimizer buffer, for an address census."""
        for section, name, owner, fields in self._tensors():
            for field, t in fields.items():
                yield f"optimizer.{section}.{name}.{field}", t
        for owner in [*self.banks, *self.adam_by_param.values()]:
            for field in ("grad", "grad_in", "gathered"):
                t = getattr(owner, field, None)
                if t is not None:
                    yield f"optimizer.{owner.name}.{field}", t
        yield "optimizer.step_values", self.step_values.values

    def state_dict(self) -> dict:
        """This rank's shards (references, not copies); see the module docstring for the format."""
        sd = dict(format=STATE_FORMAT, rank=self.rank, world_size=self.world_size,
                  adam_steps=self.adam_steps, tied=self.tied is not None, banks={}, adam={})
        for section, name, owner, fields in self._tensors():
            meta = dict(first_matrix=owner.first) if section == "banks" else \
                dict(first_row=owner.first, sharded=owner.sharded)
            sd[section][name] = {**meta, **fields}
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict):
        """Copy a state_dict() of the same rank and world size into the existing buffers."""
        if sd.get("format") != STATE_FORMAT or (sd["rank"], sd["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"optimizer state {sd.get('format')} rank {sd.get('rank')}/"
                             f"{sd.get('world_size')} does not fit {STATE_FORMAT} rank "
                             f"{self.rank}/{self.world_size}: load the checkpoint of this rank")
        if sd["tied"] and self.tied_initial is None:
            raise ValueError("optimizer state is tied but this optimizer has no tied_embed_head")
        for section, name, _, fields in self._tensors():
            for field, dst in fields.items():
                dst.copy_(sd[section][name][field])
        self.adam_steps = sd["adam_steps"]
        self.tied = self.tied_initial if sd["tied"] else None
