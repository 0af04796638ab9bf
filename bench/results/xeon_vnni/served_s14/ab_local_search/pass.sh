#!/bin/bash
# one served pass: $1 = name, $2 = config
cd /work/main
serve run $2 > /tmp/ab14/$1.serve.log 2>&1 &
for i in $(seq 1 60); do sleep 5; curl -s localhost:8000/v1/models 2>/dev/null | grep -q '"id"' && break; done
sleep 45
python -m dart_core.bench.serving --concurrency 1 --requests-per-client 16 --max-tokens 128 --modes dart no-speculation --out /tmp/ab14/$1 --no-progress > /tmp/ab14/$1.bench.log 2>&1
python - > /tmp/ab14/$1.stats.json 2>/dev/null <<'PY'
import ray, json
from ray import serve
ray.init(address="auto", namespace="serve", logging_level="ERROR")
s = serve.get_deployment_handle("DartEngine", "dart").stats.remote().result()
print(json.dumps({k: v for k, v in s.items() if k != "budget"}, default=str))
PY
pkill -f "serve run"; sleep 3; ray stop --force > /dev/null 2>&1; sleep 2
