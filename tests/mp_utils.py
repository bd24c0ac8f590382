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
