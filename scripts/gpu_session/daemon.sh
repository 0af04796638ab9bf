#!/bin/bash
# usage: setsid bash scripts/gpu_session/daemon.sh END_EPOCH GEN_END_EPOCH > /tmp/daemon.log 2>&1 &
# self-distilled answers until GEN_END, teacher features, a short calibration run, then the
# warm-started head trained for as many epochs as fit before END (cosine schedule completed).
source scripts/gpu_session/env.sh
END=$1; GEN_END=$2
log() { echo "[$(date +%T)] $*"; }
COMMON=(--dir $D --init-from dart_core/heads/SmolLM2-135M-Instruct --max-length 1280 --anchors-per-seq 256
        --lr 5e-4 --seed 6 --save-every 200 -q $EXTRA)
mins() { python3 -c "import time; print(round(max(0.1, ($1 - time.time()) / 60), 2))"; }
log "phase G: generation until $(date -d @$GEN_END +%T)"
python3 -m dart_core.train.gpu_recipe train "${COMMON[@]}" --results $R/g --max-minutes $(mins $GEN_END) \
    --generate-batch-size 512 --epochs 0.02 --eval-every 0 \
  || { log "phase G failed (rc $?); again at batch 128"; \
       python3 -m dart_core.train.gpu_recipe train "${COMMON[@]}" --results $R/g --max-minutes $(mins $GEN_END) \
           --generate-batch-size 128 --epochs 0.02 --eval-every 0; }
log "phase G ended: $(cat $R/g/status.json 2>/dev/null | tr -d '\n ' | cut -c1-400)"
wc -l $D/work/data/responses.jsonl
log "phase C: features + calibration"
python3 -m dart_core.train.gpu_recipe train "${COMMON[@]}" --results $R/cal --no-generate --epochs 0.03 \
    --eval-every 0 --max-minutes 30 || { log "phase C failed"; exit 1; }
EPOCHS=$(python3 - <<PY
import json, time
t = json.load(open("$R/cal/training.json"))
sps = t["throughput"].get("seconds_per_step") or t["wall_time_s"]["train"] / max(t["steps"], 1)
per_epoch = max(1, t["sequences"]["train"] // 8)
left = $END - time.time() - 90  # model load, evaluations, export
print(round(min(4.0, max(0.05, left / sps / per_epoch)), 3))
PY
)
log "phase T: $EPOCHS epochs (calibration: $(python3 -c "import json; t=json.load(open('$R/cal/training.json')); print(t['wall_time_s'], t['steps'], t['sequences'])"))"
python3 -m dart_core.train.gpu_recipe train "${COMMON[@]}" --results $R/final --no-generate --epochs $EPOCHS \
    --eval-every 400 --max-minutes $(mins $((END - 30))) || log "phase T failed"
log "phase T ended: $(cat $R/final/status.json 2>/dev/null | tr -d '\n ' | cut -c1-300)"
for c in $D/work/runs/*/checkpoint.pt; do ls -la $c; done
touch $R/daemon.done
log done
