#!/bin/bash
# usage: bash scripts/gpu_session/ray_wheels.sh OUT.tar
# The wheels Ray Serve needs on the GPU machine (Python 3.12, no package registry there): ray[serve]
# and what it pulls in, for CPython 3.12 on manylinux x86-64, minus the projects the machine's image
# already has (image_packages.txt).  The tar travels as an --extra file of `gpu_recipe pack` (split
# into parts, joined and checked there); there:
#   mkdir -p /tmp/rw && tar -xf $D/files/extra/ray-wheels.tar -C /tmp/rw &&
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/rw/*.whl
set -euo pipefail
out=${1:?usage: ray_wheels.sh OUT.tar}
here=$(cd "$(dirname "$0")" && pwd)
dl=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dl" "ray[serve]==2.60.0" fastapi pydantic
norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
have=$(grep -v '^#' "$here/image_packages.txt" | while read -r p; do norm "$p"; done)
kept=()
for w in "$dl"/*.whl; do
  name=$(norm "$(basename "$w" | cut -d- -f1)")
  if grep -qx "$name" <<<"$have"; then rm "$w"; else kept+=("$(basename "$w")"); fi
done
tar -cf "$out" -C "$dl" "${kept[@]}"
rm -rf "$dl"
echo "${#kept[@]} wheels, $(du -m "$out" | cut -f1) MB: $out"
