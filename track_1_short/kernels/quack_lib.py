"""quack-kernels' GEMM interface (quack.gemm_interface), imported on first use by the kernels that
call it: kernels/relu2_mlp.py (TrainConfig.mlp_kernel="quack") and kernels/polar_gemms.py
(AnvilConfig.polar_gemms="quack"). Each keeps its own `_lib` slot (the CPU tests put torch
stand-ins there); this module holds the one import and the one install hint.
"""

import importlib
from types import ModuleType

QUACK_HINT = ("pip install quack-kernels (with nvidia-cutlass-dsl-libs-cu13 for CUDA 13); on a host "
              "without a registry: scripts/gpu/fa4_wheels.sh here, fa4_install.sh there, then "
              "source .fa4_site/ENV")


def import_gemm_interface(setting: str) -> ModuleType:
    """quack.gemm_interface, or ImportError naming `setting` (the config value that asked for it),
    the package and how to install it."""
    try:
        return importlib.import_module("quack.gemm_interface")
    except ImportError as e:
        raise ImportError(f"{setting} needs quack-kernels ({e}); {QUACK_HINT}") from e
