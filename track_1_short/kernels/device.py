"""The device rule shared by the Triton kernels whose CPU path is the interpreter
(kernels/ngram_adam.py, row_accumulate.py, qk_norm_rope.py): CUDA tensors, or CPU tensors when
TRITON_INTERPRET=1 was set before triton was imported (the kernel is then an InterpretedFunction).
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def require_cuda_or_interpreter(device: torch.device, kernel, where: str, reference: str) -> None:
    """ValueError naming `where` and `reference` (what to use instead) unless `kernel` (a
    @triton.jit function of the caller's module) can run on `device`."""
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise ValueError(f"{where}: runs on CUDA (or on the CPU with TRITON_INTERPRET=1 set before "
                         f"triton is imported), got {device}; {reference}")
