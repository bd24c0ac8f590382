"""Helpers shared by the multi-process (gloo, CPU) tests: a free port and the torchrun environment."""

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rank_env(rank: int, world_size: int, port: int) -> None:
    """The variables torchrun sets, so init_distributed() sees rank `rank` of `world_size`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def gloo_worker(rank: int, world_size: int, port: int, out_dir: str, fn) -> None:
    """mp.spawn target: rank `rank` of a gloo group runs fn(rank, world_size) on one thread and
    saves its result to out_dir/rank<r>.pt (fn must be a module-level function: it is pickled)."""
    import torch

    from track_1_short.distributed import destroy_distributed, init_distributed

    set_rank_env(rank, world_size, port)
    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=60, device_type="cpu")
    if (ctx.rank, ctx.world_size, ctx.backend) != (rank, world_size, "gloo"):
        raise RuntimeError(f"init_distributed gave {ctx}, expected rank {rank} of {world_size} on gloo")
    torch.save(fn(rank, world_size), os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_distributed()


def single_thread(fn, *args):
    """fn(*args) on one intra-op thread (tiny shapes: extra threads only contend on 2 cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def rerun_in_child(request, timeout_s: float = 600) -> bool:
    """For a test that leaves its process unusable for later tests (a failed CUDA graph capture
    leaves the CUDA generator in capture state: the next torch.randn on the device raises "Offset
    increment outside graph capture"): in the test process, run this one test in a child pytest
    and return True (the caller returns); in the child, return False (the caller runs its body)."""
    import subprocess
    import sys

    if os.environ.get("T1S_TEST_CHILD") == "1":
        return False
    env = dict(os.environ, T1S_TEST_CHILD="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or not gpu",
                           request.node.nodeid], env=env, capture_output=True, text=True,
                          timeout=timeout_s, cwd=str(request.config.rootpath))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return True
