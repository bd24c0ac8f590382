"""Fp8Config: the fp8 matmul knobs (model/fp8.py), torch-free so the run config imports no runtime.

What must stay stable: nothing here holds tensors; validated when built (the message names the
field). Nested into GPTConfig.fp8 (model/gpt_config.py); `--fp8` sets `enabled`.
"""

from dataclasses import dataclass

FP8_SITES = ("lm_head", "mlp_up", "mlp_down")  # the fp8 call sites (model/fp8.py's Fp8Matmuls)
MLP_SITES = ("mlp_up", "mlp_down")
# the MLP sites the quack MLP (TrainConfig.mlp_kernel "quack", kernels/relu2_mlp.py) can run in
# fp8 itself: it runs those of them that the config asks for (trainer/build.py)
QUACK_FP8_SITES = ("mlp_up",)
MLP_BACKWARDS = ("fp8", "bf16")  # Fp8Config.mlp_backward


def quack_fp8_sites(fp8_sites) -> tuple[str, ...]:
    """The MLP sites the quack MLP runs in fp8 itself, given the sites that run in fp8: those of
    them it can (QUACK_FP8_SITES). The run config's check (config.py) and the trainer's install
    (trainer/build.py) both ask here."""
    return tuple(s for s in QUACK_FP8_SITES if s in fp8_sites)

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

    def fp8_mlp_sites(self) -> list[str]:
        """The MLP sites that run in fp8 (sorted; none unless enabled)."""
        return sorted(set(MLP_SITES) & set(self.sites)) if self.enabled else []

    def fused_mlp_refusal(self, fused_fp8_sites: tuple[str, ...]) -> str | None:
        """Why a fused MLP that runs `fused_fp8_sites` of the MLP in fp8 and its backward in bf16
        cannot take this config (None: it can). The one rule for the run config's early check
        and Fp8Matmuls.use_fused_mlp: it must run in fp8 exactly the configured MLP sites (any
        other pairing would run one in another precision than configured), and fp8 MLP sites
        need the bf16 backward."""
        mlp = self.fp8_mlp_sites()
        if mlp != sorted(fused_fp8_sites):
            return (f"runs the fp8 MLP sites {sorted(fused_fp8_sites)}: it cannot take the fp8 sites "
                    f"{mlp} (model.fp8.sites); make them agree")
        if mlp and self.mlp_backward != "bf16":
            return (f"has a bf16 backward: the fp8 sites {mlp} need model.fp8.mlp_backward=bf16 "
                    f"(got {self.mlp_backward!r})")
        return None
