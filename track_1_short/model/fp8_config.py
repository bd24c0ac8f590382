"""Fp8Config: the fp8 matmul knobs (model/fp8.py), torch-free so the run config imports no runtime.

What must stay stable: nothing here holds tensors; validated when built (the message names the
field). Nested into GPTConfig.fp8 (model/gpt_config.py); `--fp8` sets `enabled`.
"""

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class Fp8Config:
    enabled: bool = False  # fp8 lm head + MLP on CUDA >= 8.9; off until key C and loss are measured (fp8.py)
    # MLP down: forward calls per layer, after build or reset(), that quantise with the exact
    # current amax instead of the delayed scale (facts 3 "FP8 bootstrap": HEAD's steps < 16)
    bootstrap_steps: int = 16

    def __post_init__(self):
        if self.bootstrap_steps < 1:
            raise ValueError(f"Fp8Config.bootstrap_steps={self.bootstrap_steps} must be >= 1: the "
                             "first MLP-down call has no previous amax to delay")
