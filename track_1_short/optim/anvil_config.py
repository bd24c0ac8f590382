"""Configuration of AnvilAndAdam (optim/anvil.py): per-parameter configs, the name table, knobs.

What it replaces: modded-nanogpt's `param_table` / `NorMuonAndAdam` constructor arguments
(`train_gpt.py:2019-2090`), a dict literal built in code. Here the name -> ParamConfig table is data
(`PARAM_TABLE`), matched by glob patterns, and `build_param_cfgs` fails loudly on any parameter the
table does not cover, so a new model parameter can never silently go untrained.

What must stay stable: nothing here holds tensors. `AnvilConfig` is validated when built; every
rule names the field to change (tests/test_anvil_math.py has one test per rule).

Provenance: facts sections 4.1/4.2 (per-parameter betas, lr_mul, wd_mul, comm mode); the momentum
schedule and the Adam cadence (facts 3) are the schedule's (schedule.py StepPlan). Deviations: the
table covers this package's model names (value_embeds through ValueEmbedPull, no bigram table: the
n-gram rows are NgramStore's own sparse update, not the optimizer's); names of a compiled model
("_orig_mod.") are matched without that prefix.
"""

import fnmatch
from dataclasses import dataclass

from torch import nn

ANVIL, ADAM = "anvil", "adam"
ALL_REDUCE, SHARDED = "all_reduce", "sharded"
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
POLAR_GEMMS = ("torch", "quack")  # AnvilConfig.polar_gemms


@dataclass(slots=True, kw_only=True, frozen=True)
class ParamConfig:
    """How one parameter is optimised (hashable, shared by every parameter a table entry matches)."""

    optim: str  # "anvil" (banks [N, R, C] or [N, S, R, C]) or "adam"
    lr_mul: float = 1.0  # times the group's scheduled lr (AnvilConfig.lr or adam_lr)
    wd_mul: float = 1.0  # times the group's weight decay
    betas: tuple[float, float] = (0.9, 0.99)  # Adam only
    comm: str = ALL_REDUCE  # Adam only: "all_reduce" (small, replicated) or "sharded" (dim 0)
    slot_lr_muls: tuple[float, ...] = ()  # ANVIL [N, S, R, C] banks: lr_mul per slot s (mlp: c_fc, c_proj)

    def __post_init__(self):
        if self.optim not in (ANVIL, ADAM):
            raise ValueError(f"ParamConfig.optim must be 'anvil' or 'adam', got {self.optim!r}")
        if self.comm not in (ALL_REDUCE, SHARDED):
            raise ValueError(f"ParamConfig.comm must be 'all_reduce' or 'sharded', got {self.comm!r}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"ParamConfig.betas must lie in [0, 1), got {self.betas}")
        if self.lr_mul <= 0 or self.wd_mul < 0 or any(m <= 0 for m in self.slot_lr_muls):
            raise ValueError("ParamConfig.lr_mul and slot_lr_muls must be > 0 and wd_mul >= 0, got "
                             f"{self.lr_mul}, {self.slot_lr_muls}, {self.wd_mul}")
        if self.slot_lr_muls and self.optim != ANVIL:
            raise ValueError("ParamConfig.slot_lr_muls applies to ANVIL banks only")


def _adam(betas, lr_mul, wd_mul, comm=ALL_REDUCE) -> ParamConfig:
    return ParamConfig(optim=ADAM, betas=betas, lr_mul=lr_mul, wd_mul=wd_mul, comm=comm)


# (glob patterns, config); the first entry whose pattern matches the full name wins. Values: facts 4.1/4.2.
PARAM_TABLE: tuple[tuple[tuple[str, ...], ParamConfig], ...] = (
    (("qk_bank", "*.qk_bank"), ParamConfig(optim=ANVIL)),
    (("vo_bank", "*.vo_bank"), ParamConfig(optim=ANVIL)),
    # [N, 2, 3072, 768]: slot 0 c_fc, slot 1 c_proj (2x lr, so 4x with the tall shape_mult)
    (("mlp_bank", "*.mlp_bank"), ParamConfig(optim=ANVIL, slot_lr_muls=(1.0, 2.0))),
    (("embed.weight", "*.embed.weight"), _adam((0.5, 0.95), 1.0, 150.0, SHARDED)),
    (("lm_head", "lm_head.weight", "*.lm_head", "*.lm_head.weight"), _adam((0.5, 0.95), 1.0, 150.0, SHARDED)),
    # its gradient arrives in ValueEmbedPull.grad_accum (AnvilAndAdam.set_grad_buffer)
    (("value_embeds.weight", "*.value_embeds.weight", "value_embeds", "*.value_embeds"),
     _adam((0.75, 0.95), 75.0, 5.0, SHARDED)),
    (("scalars", "*.scalars"), _adam((0.9, 0.99), 5.0, 0.0)),
    (("*smear_gate*",), _adam((0.9, 0.99), 0.01, 0.0)),
    (("*ve_gate_bank",), _adam((0.9, 0.99), 1.0, 1.0)),
    (("*post_lambdas",), _adam((0.9, 0.95), 1.0, 0.0)),
    (("*resid_lambdas",), _adam((0.9, 0.95), 5.0, 0.0)),
    # model/mudd.py (GPTConfig.mudd): the gates' and the connections' MLPs
    (("*mudd_gates.w1", "*mudd_gates.w2"), _adam((0.9, 0.99), 0.1, 1.0)),
    (("*mudd_gates.b2", "*mudd_gates.scale"), _adam((0.9, 0.99), 0.1, 0.0)),
    (("*mudd_connections.w1", "*mudd_connections.w2"), _adam((0.9, 0.99), 0.25, 1.0)),
    (("*mudd_connections.b2",), _adam((0.9, 0.99), 0.25, 0.0)),
    (("*lambdas", "*lambda"), _adam((0.9, 0.99), 5.0, 0.0)),  # other scalar lambdas (smear, skip)
    (("*gate*",), _adam((0.9, 0.99), 1.0, 1.0)),  # remaining small gate weights (attention, skip)
)


def _canonical(name: str) -> str:
    return name.replace("_orig_mod.", "")


def build_param_cfgs(named_parameters, table=PARAM_TABLE) -> dict[nn.Parameter, ParamConfig]:
    """Map every parameter to the config of the first table entry matching its name; raises
    ValueError listing the parameters nothing matches (extend the table rather than guess)."""
    cfgs, unmatched = {}, []
    for name, p in named_parameters:
        cfg = next((c for patterns, c in table
                    if any(fnmatch.fnmatchcase(_canonical(name), pat) for pat in patterns)), None)
        if cfg is None:
            unmatched.append(name)
        elif cfg.optim == ANVIL and p.dim() not in (3, 4):
            raise ValueError(f"{name}: ANVIL banks are [N, R, C] or [N, S, R, C], got {tuple(p.shape)}")
        else:
            cfgs[p] = cfg
    if unmatched:
        raise ValueError(f"no optimizer config for parameters {unmatched}: add a pattern to PARAM_TABLE")
    return cfgs


@dataclass(slots=True, kw_only=True)
class AnvilConfig:
    """Optimizer knobs (defaults: the speedrun, facts 3 and 4). The per-step values (momentum, whether
    Adam updates) are not here: they come from the schedule's StepPlan (schedule.py), passed to
    AnvilAndAdam.step by the trainer."""

    lr: float = 0.023  # ANVIL base lr (times lr_scale, lr_mul, shape_mult)
    adam_lr: float = 0.008  # Adam base lr (times lr_scale, lr_mul)
    beta2: float = 0.9  # NorMuon second-moment EMA
    weight_decay: float = 1.2  # ANVIL, applied as wd * lr * lr_eff (cautious)
    adam_eps: float = 1e-10
    adam_weight_decay: float = 0.005  # applied as lr^2 * wd * wd_mul (cautious)
    ns_steps: int = 5  # Polar Express iterations (5: the published coefficients; else derived)
    ortho_dtype: str = "auto"  # Polar Express dtype: "auto" (bf16 on CUDA, fp32 on CPU), or a name
    # torch.compile(dynamic=False, fullgraph=True) anvil_math's step functions (one graph per bank
    # shard shape, per table and for the small-parameter group; per-step values are tensor inputs).
    # None: on when the parameters are on CUDA (every GPU preset), off on CPU, where inductor's C++
    # build costs ~10 s per graph on 2 cores (more than cpu-tiny spends in the optimizer). True/False
    # force it; AnvilAndAdam.compiled holds the resolved value.
    compile: bool | None = None
    compile_backend: str = "inductor"  # torch.compile backend ("aot_eager": CPU tests of the compiled path)
    # Polar Express's GEMMs: "torch" (bmm / baddbmm, the reference) or "quack" (quack-kernels'
    # gemm_symmetric / gemm_add, no copy of the C operand: kernels/polar_gemms.py; CUDA SM90 /
    # SM100 only, resolved by trainer/build.py).
    polar_gemms: str = "torch"

    def __post_init__(self):
        for name in ("lr", "adam_lr", "adam_eps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AnvilConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "adam_weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"AnvilConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.beta2 < 1:
            raise ValueError(f"AnvilConfig.beta2 must lie in [0, 1), got {self.beta2}")
        if not 1 <= self.ns_steps <= 12:
            raise ValueError(f"AnvilConfig.ns_steps must lie in [1, 12], got {self.ns_steps}")
        if self.compile not in (None, True, False):
            raise ValueError(f"AnvilConfig.compile must be None (auto), True or False, got {self.compile!r}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"AnvilConfig.compile_backend must be one of {COMPILE_BACKENDS}, got "
                             f"{self.compile_backend!r}")
        if self.polar_gemms not in POLAR_GEMMS:
            raise ValueError(f"AnvilConfig.polar_gemms (--set optim.polar_gemms) must be one of "
                             f"{POLAR_GEMMS}, got {self.polar_gemms!r}")
        if self.ortho_dtype not in ("auto", "bfloat16", "float32", "float64"):
            raise ValueError("AnvilConfig.ortho_dtype must be auto, bfloat16, float32 or float64, "
                             f"got {self.ortho_dtype!r}")
