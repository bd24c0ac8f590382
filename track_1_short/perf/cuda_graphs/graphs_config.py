"""StepGraphsConfig (`--graphs {on,off,check}` and the self-check knobs) and the capture constants,
torch-free, so the run config (config.py) imports no graph runtime. Re-exported by step_graphs.py
(the seed's home of these names); capture_support.py re-exports WARM_ITERATIONS.

What must stay stable: nothing here holds tensors; validated when built (the message names the
setting).
"""

from dataclasses import dataclass

GRAPH_MODES = ("on", "off", "check")
# Eager iterations of the step on the side stream before its capture: the first compiles (dynamo,
# inductor, Triton autotuning), the rest settle lazily allocated state (fp8 caches, allocator
# blocks) so the capture records steady-state kernels. 3 as in torch's whole-network example.
WARM_ITERATIONS = 3
# The self-check compares scalar losses of two runs of the same kernels; atomics in the loss kernels
# make them not bitwise equal (record #360's tolerance).
SELF_CHECK_ABS, SELF_CHECK_REL = 1e-3, 5e-4
# The warmup self-check also compares every gradient the backward graph wrote with an eager backward
# on the same buffers: ||replay - eager|| <= SELF_CHECK_GRAD_REL * max(||eager||, floor), floor =
# 1e-6 * the norm of all gradients (gradients that are zero up to rounding at init: facts of the
# GPU tests). A graph can replay the right loss and wrong gradients (an op that is not capture-safe
# in the backward), so the loss check alone is not enough.
SELF_CHECK_GRAD_REL = 1e-2


@dataclass(slots=True, kw_only=True)
class StepGraphsConfig:
    """`--graphs {on,off,check}` and the self-check knobs."""

    mode: str = "on"  # on: graphs; off: EagerStep; check: graphs + sampled self-checks when timed
    check_fraction: float = 0.01  # share of timed steps self-checked in mode "check"
    seed: int = 0  # seeds the choice of checked steps (same on every rank)
    self_check_abs: float = SELF_CHECK_ABS
    self_check_rel: float = SELF_CHECK_REL
    self_check_grad_rel: float = SELF_CHECK_GRAD_REL
    warm_iterations: int = WARM_ITERATIONS
    sync_debug_warmup: bool = False  # warm iterations after the first under sync debug "error"

    def __post_init__(self):
        if self.mode not in GRAPH_MODES:
            raise ValueError(f"mode={self.mode!r}: --graphs must be one of {GRAPH_MODES}")
        if not 0.0 <= self.check_fraction <= 1.0:
            raise ValueError(f"check_fraction={self.check_fraction} must be in [0, 1]")
        if min(self.self_check_abs, self.self_check_rel, self.self_check_grad_rel) < 0:
            raise ValueError("self_check_abs, self_check_rel and self_check_grad_rel must be >= 0")
        if self.warm_iterations < 1:
            raise ValueError(f"warm_iterations={self.warm_iterations} must be >= 1 (the first "
                             f"compiles; capturing a compile is not possible)")
