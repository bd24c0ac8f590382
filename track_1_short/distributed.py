"""Process-group setup in one place: torchrun environment -> DistributedContext.

What it replaces: modded-nanogpt's import-time `dist.init_process_group` + module-level rank /
world_size globals (`train_gpt.py:52-64`, STYLE rule 2's counter-example). Nothing happens at import:
train.py's main() calls `init_distributed()` once and passes the context down; tests run in one
process without any process group.

Contract:
- `init_distributed(timeout_s)` reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (as set
  by torchrun). WORLD_SIZE unset or 1: single process, no process group (every collective in the
  package is skipped when world_size == 1). Otherwise NCCL on CUDA (one device per local rank,
  bound eagerly with device_id) or gloo on CPU.
- Dead or stuck ranks: every collective has `timeout_s`. On NCCL the watchdog aborts the
  communicator when a collective exceeds it and raises in the waiting rank (torch's default
  TORCH_NCCL_ASYNC_ERROR_HANDLING=3 tears down instead of hanging; we do not override a value the
  launcher set); gloo raises at once when a peer's connection closes. Neither error says which
  rank is gone (gloo names a host:port, and a monitored_barrier over the broken group fails the
  same way), so after such a failure (`is_comm_failure`) the trainer asks `lost_ranks()`: every
  surviving rank checks in at the rendezvous store, and the ranks that never do are named.
- `health_group`: a gloo group on the CPU (the world group itself under gloo) for the trainer's
  host-side agreements (the run id, the run dir claim, the graceful stop), which must not wait
  on the GPU stream.
- `destroy_distributed()` is safe to call when nothing was initialised.

Provenance: torchtitan `torchtitan/distributed/utils.py` (init in one function, timeouts), lingua
`lingua/distributed.py` (`DistributedArgs`, env parsing). Deviation: no device mesh (pure data
parallel + the optimizer's own sharding).
"""

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(slots=True, kw_only=True)
class DistributedContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # "nccl", "gloo", or None (single process, no process group)
    health_group: object | None = field(default=None, repr=False)  # gloo group for host agreements

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.lstrip("-").isdigit():
        raise ValueError(f"{name}={value!r}: launch with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK)")
    return int(value)


def init_distributed(timeout_s: float = 300.0, device_type: str | None = None) -> DistributedContext:
    """Start the process group described by the torchrun environment (see the module docstring).
    device_type: "cuda" or "cpu"; default cuda when available."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        return DistributedContext(rank=0, world_size=1, local_rank=0, device=device, backend=None)
    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"{missing} unset: launch with torchrun or export them")
    timeout = timedelta(seconds=timeout_s)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
        backend = "gloo"
    health = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    return DistributedContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                              backend=backend, health_group=health)


def is_comm_failure(error: BaseException) -> bool:
    """A collective failed because a peer is gone (gloo's closed connection, NCCL's abort)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer",
                                      "NCCL communicator was aborted", "Broken pipe"))


def lost_ranks(ctx: DistributedContext, tag: str, wait_s: float) -> list[int]:
    """After a failed collective: the ranks that do not check in within wait_s.

    Every surviving rank writes `t1s/alive/<tag>/<rank>` to the rendezvous store (a TCP server
    beside rank 0 that outlives a dead worker's connections, unlike the process group's) and waits
    for the others' keys; a rank whose key never comes is named."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"t1s/alive/{tag}/{ctx.rank}", "1")
    keys = {r: f"t1s/alive/{tag}/{r}" for r in range(ctx.world_size)}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        missing = [r for r, key in keys.items() if not store.check([key])]
        if not missing:
            return []
        time.sleep(0.1)
    return missing


def destroy_distributed():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
