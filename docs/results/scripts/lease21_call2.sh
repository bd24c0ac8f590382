#!/usr/bin/env bash
# Twenty-first lease, call 2 (planned, not run yet: see call 1), right after call 1 on the same warm machine (carry [".carry/fa4a"]
# alone: the 64 MiB limit; call 3 carries .carry/fa4b): the small-gpu preset at one micro-step,
# graphs on then off, each ~188 steps against call 1's warm caches, then `report compare`
# (scripts/gpu/micro1_compare.sh run). Prediction: graphs on faster per step by ~0-10% (the
# small-gpu model's micro-step is GPU-bound on an H200 at these shapes), same losses to the
# self-check's tolerance.
bash scripts/gpu/micro1_compare.sh run
