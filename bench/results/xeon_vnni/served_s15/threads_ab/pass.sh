#!/bin/bash
# One served pass: bash pass.sh NAME CONFIG OUT
#   a fresh `serve run CONFIG`, 40 s idle, then 1 client (8 requests, 2 passes per mode) and
#   8 clients (4 requests each, 2 passes per mode), DART against "speculative": false, 128 tokens,
#   MT-Bench; the engine's stats after each level (engine_stats.py).
# CONFIG: deployments/dart.yaml ("base", OMP_NUM_THREADS 2) or a copy with OMP_NUM_THREADS "1" ("omp1").
# Run order for this folder: base-1, omp1-1, omp1-2, base-2, omp1-3, base-3.
name=$1 config=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
cd "$(git rev-parse --show-toplevel)"
serve run "$config" > "$out/$name.serve.log" 2>&1 &
for i in $(seq 1 60); do sleep 5; curl -s localhost:8000/v1/models 2>/dev/null | grep -q '"id"' && break; done
sleep 40
python -m dart_core.bench.serving --concurrency 1 --requests-per-client 8 --max-tokens 128 --repeats 2 --out "$out/$name-c1" --no-progress
python "$here/engine_stats.py" > "$out/$name-c1.stats.json" 2>/dev/null
python -m dart_core.bench.serving --concurrency 8 --requests-per-client 4 --max-tokens 128 --repeats 2 --out "$out/$name-c8" --no-progress
python "$here/engine_stats.py" > "$out/$name-c8.stats.json" 2>/dev/null
pkill -f "serve run"; sleep 3; ray stop --force > /dev/null 2>&1; sleep 2
