"""The trainer's command line: `python -m track_1_short.train [flags]` (README: trainer flags).

What it replaces: modded-nanogpt's 2,400-line train_gpt.py main section. The run itself is the
trainer package (track_1_short/trainer/): lifecycle.py orders the phases (checks, claim, build,
warmup + capture, reset, census, seal, timed run, finish) and returns the exit code; build.py
applies every systems concern to the model in one ordered place; step.py holds the one
train_step that every phase and both step runners (graphs on or off) share.
"""

from __future__ import annotations

import sys

from track_1_short import config as config_mod
from track_1_short.trainer.lifecycle import train

__all__ = ["main", "train"]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: flags -> RunConfig (bad flags exit 2) -> trainer.lifecycle.train()."""
    return train(config_mod.parse(argv))


if __name__ == "__main__":
    sys.exit(main())
