#!/usr/bin/env bash
# On the device machine, in the second of the two calls of scripts/gpu/fa4_wheels.sh: joins the
# tarball's halves (.carry/fa4a from the first call, .carry/fa4b from this one), checks it against
# SHA256SUMS and unpacks it into .fa4_site/site-packages (git-ignored); a fallback package
# (einops, cuda.bindings, cuda.pathfinder, google.protobuf: the image holds them, so the tarball
# has them only when built with FA4_FALLBACK=1) is added only where this Python lacks it; one
# missing from both is exit 2. Then `source .fa4_site/ENV` (it sets PYTHONPATH) and python3 imports flash_attn.cute (or
# exit 2) and quack's GEMM epilogues (a failure there is printed: `--mlp-kernel quack` would fail).
#   bash scripts/gpu/fa4_install.sh       (from the repo root; exit 2 with the reason otherwise)
# The folder must be named site-packages: quack fingerprints the Python functions its epilogues
# call, and treats a function as an installed library's (keyed by name, not recursed into) only
# where its file lies under a site-packages or dist-packages folder; from any other folder it
# recurses into cutlass's internals and fails on a ContextVar there (measured on the H200 with
# quack-kernels 0.6.5 and nvidia-cutlass-dsl 4.8.1: `epilogue fn depends on <ContextVar name=
# '_LOC_TRANSFORMS' ...>`, docs/results/step_variants_h200_2026-12-01/fa4_quack_gpu_tests.log).
set -euo pipefail
A=.carry/fa4a B=.carry/fa4b ROOT=.fa4_site
SITE=$ROOT/site-packages
[[ -f $A/SHA256SUMS && -f $A/fa4.tar.xz.part0 ]] || { echo "fa4_install: $A missing: carry it in the" \
    "call just before this one (a warm machine keeps it for its idle window, ~30 s)" >&2; exit 2; }
[[ -f $B/fa4.tar.xz.part1 ]] || { echo "fa4_install: $B/fa4.tar.xz.part1 missing: carry .carry/fa4b" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat $A/fa4.tar.xz.part0 $B/fa4.tar.xz.part1 > "$work/fa4.tar.xz"
sums=$(realpath $A/SHA256SUMS)
(cd "$work" && sha256sum -c --quiet "$sums") || {
  echo "fa4_install: the joined tarball does not match $A/SHA256SUMS (halves of two different" \
       "fa4_wheels.sh runs?): run it again and carry both" >&2; exit 2; }
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
    "$work/fa4.tar.xz" "$work"
rm -rf "$ROOT"
mkdir -p "$ROOT"
mv "$work/fa4/site" "$SITE"
added=()
# MODULE:PATH:DIST-INFO prefix; cuda and google are namespace packages, so a sub-package is added
# beside the host's others
for entry in einops:einops:einops- cuda.bindings:cuda/bindings:cuda_bindings- \
             cuda.pathfinder:cuda/pathfinder:cuda_pathfinder- google.protobuf:google/protobuf:protobuf-; do
  IFS=: read -r module path dist <<< "$entry"
  python3 -c "import $module" 2>/dev/null && continue
  [[ -d "$work/fa4/fallback/$path" ]] || {
    echo "fa4_install: this Python lacks $module and the tarball has no fallback for it: run" \
         "FA4_FALLBACK=1 bash scripts/gpu/fa4_wheels.sh here and carry both halves again" >&2
    rm -rf "$ROOT"; exit 2; }
  mkdir -p "$SITE/$(dirname "$path")"
  cp -r "$work/fa4/fallback/$path" "$SITE/$path"
  cp -r "$work"/fa4/fallback/"$dist"*.dist-info "$SITE/"
  added+=("$module")
done
# nvidia-cutlass-dsl puts its `cutlass` package on sys.path through a .pth file, which Python
# reads in site directories only, not on PYTHONPATH: .fa4_site/ENV names both folders instead
paths="$PWD/$SITE:$PWD/$SITE/nvidia_cutlass_dsl/dsl_packages"
echo "export PYTHONPATH=$paths:\${PYTHONPATH:-.}" > "$ROOT/ENV"
echo "fa4_install: $(tr '\n' ' ' < $A/PINS)-> $SITE (fallbacks added: ${added[*]:-none}); source $ROOT/ENV"
source "$ROOT/ENV"
python3 -c "import cutlass, flash_attn.cute.interface as i; print('fa4_install: flash_attn.cute from', i.__file__)" || {
  echo "fa4_install: flash_attn.cute does not import (above)" >&2; exit 2; }
python3 -c "import quack.epilogue.library as e; print('fa4_install: quack epilogues from', e.__file__)" ||
  echo "fa4_install: quack's GEMM epilogues do not import (above): --mlp-kernel quack will fail" >&2
