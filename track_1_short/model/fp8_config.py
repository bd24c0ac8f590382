"""Fp8Config: the fp8 matmul knobs (model/fp8.py), torch-free so the run config imports no runtime.

What must stay stable: nothing here holds tensors; validated when built (the message names the
field). Nested into GPTConfig.fp8 (model/gpt_config.py); `--fp8` sets `enabled`.
"""

from dataclasses import dataclass

FP8_SITES = ("lm_head", "mlp_up", "mlp_down")  # the fp8 call sites (model/fp8.py's Fp8Matmuls)
MLP_BACKWARDS = ("fp8", "bf16")  # Fp8Config.mlp_backward


@dataclass(slots=True, kw_only=True)
class Fp8Config:
    enabled: bool = False  # fp8 lm head + MLP on CUDA >= 8.9; off until every key is timed (fp8.py)
    # MLP down: forward calls per layer, after build or reset(), that quantise with the exact
    # current amax instead of the delayed scale (facts 3 "FP8 bootstrap": HEAD's steps < 16)
    bootstrap_steps: int = 16
    # the call sites that run in fp8 when enabled (the others stay bf16); without "lm_head" the
    # fused lm-head + softcapped CE kernel keeps the (bf16) lm head, e.g. ("mlp_up", "mlp_down")
    sites: tuple[str, ...] = FP8_SITES
    # the MLP sites' backward: "fp8" (the output gradient in e5m2 by its current amax, both
    # gradient GEMMs in fp8; ours so far) or "bf16" (the plain backward from the saved bf16 x and
    # w: HEAD's MLP, whose backward stays bf16, facts 1.7); the lm head's is always fp8
    mlp_backward: str = "fp8"

    def __post_init__(self):
        unknown = [s for s in self.sites if s not in FP8_SITES]
        if unknown or not self.sites:
            raise ValueError(f"Fp8Config.sites={self.sites}: a non-empty subset of {FP8_SITES}")
        if self.mlp_backward not in MLP_BACKWARDS:
            raise ValueError(f"Fp8Config.mlp_backward={self.mlp_backward!r}: one of {MLP_BACKWARDS}")
        if self.bootstrap_steps < 1:
            raise ValueError(f"Fp8Config.bootstrap_steps={self.bootstrap_steps} must be >= 1: the "
                             "first MLP-down call has no previous amax to delay")
