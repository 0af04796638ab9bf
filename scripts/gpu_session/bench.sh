# usage: bash scripts/gpu_session/bench.sh JOB ...  -> JSON under $R/rep (named as gpu_report reads them), logs in $R/rep/logs
source scripts/gpu_session/env.sh
mkdir -p $R/rep/logs $R/b
MT=$D/files/extra/mt-bench.jsonl
DS="--datasets $MT $D/files/extra/humaneval.jsonl --num-prompts 2 --max-new-tokens 64 --repeats 1 --device cuda --no-progress"
for job in "$@"; do
  t0=$(date +%s); echo "[$(date +%T)] $job"
  graphs=; [[ $job == *-graphs ]] && graphs=--cuda-graphs  # JOB-graphs: the same run with --cuda-graphs
  case ${job%-graphs} in
    dec-fp32)   cmd="dart_core.bench $DS --dtype float32 --methods autoregressive dart-context" ;;
    dec-bf16)   cmd="dart_core.bench $DS --dtype bfloat16 --methods autoregressive dart dart-context" ;;
    prof-bf16)  cmd="dart_core.bench.step_profile --dataset $MT --num-prompts 1 --max-new-tokens 32 --device cuda --dtype bfloat16 --no-progress" ;;
    # the operators of DART steps that always draft (a fixed budget: the adaptive one may not speculate)
    ops-bf16)   cmd="dart_core.bench.step_profile --dataset $MT --num-prompts 1 --max-new-tokens 32 --device cuda --dtype bfloat16 --modes dart --budget 60 --top-ops 12 --no-progress" ;;
    ops-fp32)   cmd="dart_core.bench.step_profile --dataset $MT --num-prompts 1 --max-new-tokens 32 --device cuda --dtype float32 --modes dart --budget 60 --top-ops 12 --no-progress" ;;
    batch-bf16) cmd="dart_core.bench.batching --concurrency 1 4 16 64 --requests-per-client 1 --max-tokens 64 --dataset $MT --device cuda --dtype bfloat16 --no-progress" ;;
    *) echo "unknown job $job"; continue ;;
  esac
  python3 -m $cmd $graphs --out $R/b/$job > $R/rep/logs/$job.log 2>&1
  rc=$?
  label=${job#*-}; kind=${job%%-*}
  case $kind in dec) f=decoding;; prof) f=step_profile;; ops) f=step_profile; label=ops-$label;; batch) f=batching;; esac
  [ -f $R/b/$job/$f.json ] && cp $R/b/$job/$f.json $R/rep/$f-$label.json
  echo "[$(date +%T)] $job rc=$rc $(( $(date +%s) - t0 )) s"; tail -4 $R/rep/logs/$job.log | cut -c1-300
done
