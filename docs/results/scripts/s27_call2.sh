#!/usr/bin/env bash
# Twenty-seventh session, call 2, right after call 1 (docs/results/scripts/s26_call7.sh, which
# carried [".carry/fa4a", ".carry/tiktoken"]); carry [".carry/fa4b"]. The fa4 tarball, built
# without the fallbacks (scripts/gpu/fa4_wheels.sh), with 20.6 MiB of tracked files leaves no room
# for data/embedded beside fa4b: this call only joins and installs it (fa4_install.sh, which
# checks that the image holds einops, cuda.bindings, cuda.pathfinder and protobuf), and call 3
# carries the data.
source scripts/gpu/common.sh
use_fa4_packages
cat "$L/fa4_install.log"
python3 -c "import quack, flash_attn.cute; print('quack', quack.__version__)"
pack_outputs
