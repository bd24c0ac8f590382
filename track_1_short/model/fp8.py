"""fp8 matmuls for the lm head and the MLP, with address-stable scale buffers. INTERFACE ONLY so far.

What it will replace: the plain bf16 GEMMs of the lm head and the MLP with torch._scaled_mm (e4m3
forward operands, e5m2 gradients) as HEAD modded-nanogpt does (facts 1.7: lm head static scales
x_s = 100/448, w_s = 1.6/448, grad_s = grad_scale*0.75/448; MLP per-layer amax scales).

Status: only the bf16/fp32 path is implemented (`Fp8Matmuls.matmul` = x @ w in x's dtype). With
`Fp8Config.enabled=True`, `resolve(device)` warns once and falls back to that path on every device:
the _scaled_mm path is not written yet because it cannot be tested on the CPU build machine.
TODO(model owner): implement and GPU-test the _scaled_mm forward/backward.

What must stay address-stable: every scale is a registered float32 0-d buffer in ITS OWN storage
(cuBLASLt on torch 2.11+cu130 refused `_scaled_mm` scales at a 4-byte offset inside a larger buffer,
CUBLAS_STATUS_NOT_SUPPORTED, DESIGN.md section 4), updated in place only; reset() restores them in
place. Call order: built by GPT; `resolve` once by the trainer after .to(device); `matmul` inside
the forward.

Legend: T tokens, K inner dim, N output dim.
"""

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

E4M3_MAX = 448.0
LM_HEAD_X_SCALE = 100.0 / E4M3_MAX  # facts 1.7
LM_HEAD_W_SCALE = 1.6 / E4M3_MAX
LM_HEAD_GRAD_SCALE = 0.75 / E4M3_MAX


@dataclass(slots=True, kw_only=True)
class Fp8Config:
    enabled: bool = False  # --no-fp8 sets False; True currently warns and runs bf16 (see module doc)


class Fp8Matmuls(nn.Module):
    """Scale buffers for the lm head and each MLP layer's up/down projections, plus the matmul."""

    def __init__(self, cfg: Fp8Config, num_layers: int):
        super().__init__()
        self.cfg = cfg
        self.active = False  # set by resolve(); False = bf16/fp32 path
        initial = {"lm_head_x_scale": LM_HEAD_X_SCALE, "lm_head_w_scale": LM_HEAD_W_SCALE,
                   "lm_head_grad_scale": LM_HEAD_GRAD_SCALE}
        for i in range(num_layers):
            initial[f"mlp_up_scale_{i}"] = 1.0
            initial[f"mlp_down_scale_{i}"] = 1.0
        self.initial = initial
        for name, value in initial.items():
            # one registration = one allocation: each scale has its own aligned storage
            self.register_buffer(name, torch.tensor(value, dtype=torch.float32))

    def resolve(self, device: torch.device) -> bool:
        """Whether fp8 runs on `device`; warns when it was asked for but is not available."""
        if self.cfg.enabled:
            warnings.warn("Fp8Config.enabled=True: the fp8 (_scaled_mm) path is not implemented yet; "
                          f"running bf16 matmuls on {device}", stacklevel=2)
        self.active = False
        return self.active

    def matmul(self, x: Tensor, w: Tensor) -> Tensor:
        """x [T, K] @ w [K, N] -> [T, N] in x's dtype."""
        return x @ w.to(x.dtype)

    @torch.no_grad()
    def reset(self):
        for name, value in self.initial.items():
            getattr(self, name).fill_(value)
