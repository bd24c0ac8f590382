#!/usr/bin/env bash
# Nineteenth lease, call 4, right after call 3 on the same warm machine (carry []: the machine held
# .carry/fa4a, .carry/fa4b, .carry/tiktoken and data/embedded from calls 1-3): the small-gpu preset's
# warmup with the fast set, every cache fresh, Triton's too (unlike lease17_call4.sh, which left
# Triton's warm). Code at 531e416; it ran as this script's body then, since moved unchanged into
# scripts/gpu/cold_warmup.sh. 346 s wall.
bash scripts/gpu/cold_warmup.sh
