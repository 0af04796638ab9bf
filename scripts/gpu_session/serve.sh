# usage: bash scripts/gpu_session/serve.sh [CONCURRENCY ...]   (default 1 16)
# The main job on the GPU machine: `serve run` of deployments/dart.yaml with the engine replica on the
# GPU (num_gpus 1, bf16, cuda_graphs true), the n-gram service beside it on the same machine, then
# `python -m dart_core.bench.serving` over HTTP (DART and "speculative": false on the same server).
# Needs Ray unpacked in /tmp/site (ray_site.sh makes the tarball; there: tar -xJf raysite.tar.xz -C /tmp)
# and the model staged (setup_model.sh).  Results: $R/rep/serving-gpu.json, logs in $R/rep/logs.
source scripts/gpu_session/env.sh
export RAY_USAGE_STATS_ENABLED=0
mkdir -p $R/rep/logs $R/b
conc=("$@"); [ ${#conc[@]} -gt 0 ] || conc=(1 16)
python3 - <<'EOF'
import json, os
import yaml
cfg = yaml.safe_load(open("deployments/dart.yaml"))
app = cfg["applications"][0]
app["args"]["cuda_graphs"] = True
app["args"].update(json.loads(os.environ.get("SERVE_ARGS") or "{}"))  # e.g. {"budget": 60}
for d in app["deployments"]:
    if d["name"] == "DartEngine":
        d["ray_actor_options"]["num_gpus"] = 1
yaml.safe_dump(cfg, open("/tmp/dart-gpu.yaml", "w"), sort_keys=False)
EOF
t0=$(date +%s)
setsid nohup python3 -m ray.serve.scripts run /tmp/dart-gpu.yaml > $R/rep/logs/serve.log 2>&1 &
ready=
for _ in $(seq 1 150); do
  sleep 2
  if python3 -c "import urllib.request as u; u.urlopen('http://localhost:8000/v1/models', timeout=2)" 2>/dev/null; then
    ready=1; break
  fi
done
echo "[$(date +%T)] serve ready=${ready:-no} after $(( $(date +%s) - t0 )) s"
if [ -z "$ready" ]; then grep -i -B2 -A8 "error\|traceback" $R/rep/logs/serve.log | tail -60; exit 1; fi
MT=$D/files/extra/mt-bench.jsonl
# warm-up: the first batches capture their CUDA graphs
python3 -m dart_core.bench.serving --concurrency 1 16 --requests-per-client 1 --max-tokens 32 \
  --dataset $MT --out $R/b/serve-warm --no-progress > $R/rep/logs/serve-warm.log 2>&1
python3 -m dart_core.bench.serving --concurrency "${conc[@]}" --requests-per-client 2 --max-tokens 128 \
  --dataset $MT --out $R/b/serve --no-progress > $R/rep/logs/serving.log 2>&1
rc=$?
[ -f $R/b/serve/serving.json ] && cp $R/b/serve/serving.json $R/rep/serving-gpu${SERVE_TAG:+-$SERVE_TAG}.json
echo "[$(date +%T)] serving rc=$rc, $(( $(date +%s) - t0 )) s in all"; tail -12 $R/rep/logs/serving.log | cut -c1-300
python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
