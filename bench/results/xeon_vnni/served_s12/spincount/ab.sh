#!/usr/bin/env bash
# usage: ab.sh YAML OUT  - serve YAML, run 1-client dart + no-spec, 16 requests each, stop
cd "$(git rev-parse --show-toplevel)"; mkdir -p /tmp/ab
pkill -f "serve run"; ray stop --force >/dev/null 2>&1; sleep 2
nohup serve run $1 > /tmp/ab/$2.serve.log 2>&1 &
for i in $(seq 1 60); do sleep 5; grep -q "DART engine ready" /tmp/ab/$2.serve.log && break; done; sleep 5
python -m dart_core.bench.serving --concurrency 1 --repeats 1 --max-tokens 128 --requests-per-client 16 --modes dart no-speculation --no-progress --out /tmp/ab/$2 > /tmp/ab/$2.log 2>&1
grep "^| 1 |" /tmp/ab/$2/serving.md | head -2 | sed "s/^/$2 /"
pkill -f "serve run"; ray stop --force >/dev/null 2>&1
