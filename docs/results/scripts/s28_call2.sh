#!/usr/bin/env bash
# Twenty-eighth session, call 2, right after call 1 (docs/results/scripts/s26_call7.sh, carry
# [".carry/fa4a", ".carry/tiktoken"]); carry [".carry/fa4b", "data/embedded"]: the fa4 tarball cut
# again (FA4_RECUT=1 scripts/gpu/fa4_wheels.sh: first part 41.1 MiB, second 31.7 MiB) so the second
# part and the data fit one call beside the 20.6 MiB of tracked files. Installs fa4 + quack
# (host_bound.sh's use_fa4_packages_for) and runs s27_call3.sh's measurement: host_bound at A and C,
# one micro-step, graphs on and off, fast set + train.blas=no_workspace + optim.polar_gemms=quack,
# with narrow_linear's weight gradient as a chunked float32 bmm; its prediction stands.
bash docs/results/scripts/s27_call3.sh
