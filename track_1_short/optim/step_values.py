"""StepValues: the optimizer's per-step Python values as one device tensor, written in place.

What it replaces: 0-d CPU float64 tensors made per step and passed into the update math (facts
4.2: a compiled update must see lr and momentum as inputs, not constants). A CPU scalar reaches a
kernel as a launch argument read on the host at launch time, so a CUDA graph would bake it; here the
values live in one fp32 tensor on the parameters' device, which the update math reads by address,
so a captured optimizer step reads each step's values from the same memory.

How it writes without a host sync: `write(values)` fills one slot of a small ring of pinned host
buffers, then copies that slot into the device tensor with one non-blocking H2D copy on the current
stream, and records an event behind it. A slot is refilled only after its event, i.e. after the
copy that last read it ran: the host waits only when it runs RING_SLOTS steps ahead of the device
(the same guard as the data loader's pinned ring). On CPU the copy is a plain in-place copy.

What must stay stable: `values` is allocated once and only written in place (a capture bakes its
address; AnvilAndAdam.named_state_tensors lists it). Call order: write() before the device work
that reads `values` (outside any captured region: a graph would bake the ring slot's address).

Legend: S values per step.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

RING_SLOTS = 4  # steps the host may run ahead before write() waits on the device


class StepValues:
    def __init__(self, num_values: int, device: torch.device):
        self.values: Tensor = torch.zeros(num_values, dtype=torch.float32, device=device)  # [S]
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._host = [torch.zeros(num_values, dtype=torch.float32, pin_memory=True)
                          for _ in range(RING_SLOTS)]  # [S] each
            self._copied = [torch.cuda.Event() for _ in range(RING_SLOTS)]
        self._next = 0

    def write(self, values: Sequence[float]) -> None:
        """values (S floats, in double) -> self.values (fp32), in place, no host sync."""
        assert len(values) == self.values.numel(), \
            f"StepValues.write: {len(values)} values for {self.values.numel()} slots"
        if not self._cuda:
            self.values.copy_(torch.tensor(values, dtype=torch.float64))
            return
        slot = self._next
        self._next = (slot + 1) % RING_SLOTS
        # the copy that last read this slot must have run before the host overwrites it
        if not self._copied[slot].query():
            self._copied[slot].synchronize()
        self._host[slot].numpy()[:] = values
        self.values.copy_(self._host[slot], non_blocking=True)
        self._copied[slot].record()
