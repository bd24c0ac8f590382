#!/usr/bin/env bash
# On the device machine, in the second of the two calls of scripts/gpu/fa4_wheels.sh: joins the
# tarball's halves (.carry/fa4a from the first call, .carry/fa4b from this one), checks it against
# SHA256SUMS and unpacks it into .fa4_site (git-ignored); a fallback package (einops,
# cuda.bindings, cuda.pathfinder, google.protobuf) is added only where this Python lacks it. Then
# `source .fa4_site/ENV` (it sets PYTHONPATH) and python3 imports flash_attn.cute.
#   bash scripts/gpu/fa4_install.sh       (from the repo root; exit 2 with the reason otherwise)
set -euo pipefail
A=.carry/fa4a B=.carry/fa4b SITE=.fa4_site
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
rm -rf "$SITE"
mv "$work/fa4/site" "$SITE"
added=()
# MODULE:PATH:DIST-INFO prefix; cuda and google are namespace packages, so a sub-package is added
# beside the host's others
for entry in einops:einops:einops- cuda.bindings:cuda/bindings:cuda_bindings- \
             cuda.pathfinder:cuda/pathfinder:cuda_pathfinder- google.protobuf:google/protobuf:protobuf-; do
  IFS=: read -r module path dist <<< "$entry"
  python3 -c "import $module" 2>/dev/null && continue
  mkdir -p "$SITE/$(dirname "$path")"
  cp -r "$work/fa4/fallback/$path" "$SITE/$path"
  cp -r "$work"/fa4/fallback/"$dist"*.dist-info "$SITE/"
  added+=("$module")
done
# nvidia-cutlass-dsl puts its `cutlass` package on sys.path through a .pth file, which Python
# reads in site directories only, not on PYTHONPATH: .fa4_site/ENV names both folders instead
paths="$PWD/$SITE:$PWD/$SITE/nvidia_cutlass_dsl/dsl_packages"
echo "export PYTHONPATH=$paths:\${PYTHONPATH:-.}" > "$SITE/ENV"
echo "fa4_install: $(tr '\n' ' ' < $A/PINS)-> $SITE (fallbacks added: ${added[*]:-none}); source $SITE/ENV"
source "$SITE/ENV"
python3 -c "import cutlass, flash_attn.cute.interface as i; print('fa4_install: flash_attn.cute from', i.__file__)"
