"""torch.optim.AdamW behind AnvilAndAdam's trainer-facing interface (`--optimizer adamw`).

What it is for: the baseline the foundation trainer used before AnvilAndAdam landed, kept so the
two can be compared on the same preset (the optimizer issue asks for both val losses). Every
parameter is "adam" and updates every step: `--optimizer adamw` sets the schedule's adam_every to 1
(config.py; RunConfig refuses another value), so every StepPlan has adam_step and adam_first and
the step handoff copies each step's gradient afresh. step() takes AnvilAndAdam's arguments and
ignores momentum (AdamW has none) and adam_step (always True under that schedule).
value_embeds' gradient arrives in ValueEmbedPull.grad_accum (its autograd function never fills
p.grad), so step() points the parameter's .grad at that buffer and zeroes it in place after the
update.

Single process only (no sharding or reductions): a baseline for cpu-tiny, not for the speedrun.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from track_1_short.optim.anvil_config import ParamConfig


class AdamWBaseline:
    """Concern: the AdamW baseline behind the trainer's optimizer interface (single process)."""

    def __init__(self, named_parameters, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95)):
        params = [p for _, p in named_parameters]
        self.param_cfgs: dict[nn.Parameter, ParamConfig] = {p: ParamConfig(optim="adam") for p in params}
        self.base_lr = lr
        self.opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.grad_buffers: dict[nn.Parameter, Tensor] = {}

    def set_grad_buffer(self, param: nn.Parameter, buffer: Tensor) -> None:
        self.grad_buffers[param] = buffer

    def step(self, step: int, lr_scale: float, momentum: float, adam_step: bool) -> None:
        """One AdamW update; momentum and adam_step are ignored (module docstring)."""
        for p, buf in self.grad_buffers.items():
            p.grad = buf
        for group in self.opt.param_groups:
            group["lr"] = self.base_lr * lr_scale
        self.opt.step()
        with torch.no_grad():
            for buf in self.grad_buffers.values():
                buf.zero_()
        for p in self.param_cfgs:
            p.grad = None

    def reset(self) -> None:
        self.opt.state.clear()

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)
