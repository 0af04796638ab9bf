# usage: bash scripts/gpu_session/bench.sh JOB[:VARIANT] ...  -> JSON under $R/rep (named as gpu_report reads
# them), logs in $R/rep/logs.  VARIANT sdpa-default runs under PyTorch's own SDPA backend choice
# (DART_SDPA_BACKENDS=default), draft-eager keeps the draft head eager beside graph-captured
# verification (DART_DRAFT_GRAPHS=0); for the batching job, nocap lets every batch up to 64 speculate
# (--max-speculative-batch 64, the gate still deciding) and nogate speculates at every step of those
# (--no-gate as well); wide attends over the static cache's whole capacity (DART_STATIC_WINDOWS=off), repeat
# repeats the key/value heads in masked attention (DART_GROUPED_QUERY=off), old does both (the attention as it
# was up to the eighth GPU run); variants combine with + (nogate+old); the variant is appended to the result's label.  prof16-bf16 profiles a batch of 16
# (step_profile-b16-*.json), ops16-bf16 the same batch by operator (step_profile-ops-b16-*.json), py16-bf16 its
# autoregressive and gated-off steps by Python function (step_profile-py-b16-*.json);
# gate-bf16 logs the speculation gate at one client (batching-gate-*.json, the log in
# rep/logs); struct-bf16 runs the structured-output benchmark (structured-*.json; needs
# llguidance's wheel unzipped into /tmp/site, STRUCT_TOKENS / STRUCT_RUNS size it).
source scripts/gpu_session/env.sh
mkdir -p $R/rep/logs $R/b
MT=$D/files/extra/mt-bench.jsonl
DS="--datasets $MT $D/files/extra/humaneval.jsonl --num-prompts ${BENCH_PROMPTS:-2} --max-new-tokens 64 --repeats 1 --device cuda --no-progress"
for spec in "$@"; do
  t0=$(date +%s); echo "[$(date +%T)] $spec"
  job=${spec%%:*}; variant=; [[ $spec == *:* ]] && variant=${spec#*:}
  envs=(); extra=; bad=
  for v in ${variant//+/ }; do  # variants combine with +, e.g. batch-bf16-graphs:nogate+wide
    case $v in
      nocap) extra="--max-speculative-batch 64" ;;
      nogate) extra="--max-speculative-batch 64 --no-gate" ;;
      sdpa-default) envs+=(DART_SDPA_BACKENDS=default) ;;
      draft-eager) envs+=(DART_DRAFT_GRAPHS=0) ;;
      wide) envs+=(DART_STATIC_WINDOWS=off) ;;
      repeat) envs+=(DART_GROUPED_QUERY=off) ;;
      old) envs+=(DART_STATIC_WINDOWS=off DART_GROUPED_QUERY=off) ;;
      *) echo "unknown variant $v"; bad=1 ;;
    esac
  done
  [ -n "$bad" ] && continue
  graphs=; [[ $job == *-graphs ]] && graphs=--cuda-graphs  # JOB-graphs: the same run with --cuda-graphs
  case ${job%-graphs} in
    dec-fp32)   cmd="dart_core.bench $DS --dtype float32 --methods autoregressive dart-context" ;;
    dec-bf16)   cmd="dart_core.bench $DS --dtype bfloat16 --methods autoregressive dart dart-context" ;;
    prof-bf16)  cmd="dart_core.bench.step_profile --dataset $MT --num-prompts 1 --max-new-tokens 32 --device cuda --dtype bfloat16 --no-progress" ;;
    # the operators of autoregressive steps and of DART steps that always draft (a fixed budget: the adaptive one may not)
    ops-bf16)   cmd="dart_core.bench.step_profile --dataset $MT --num-prompts 1 --max-new-tokens 32 --device cuda --dtype bfloat16 --modes autoregressive dart --budget 60 --top-ops 12 --no-progress" ;;
    ops-fp32)   cmd="dart_core.bench.step_profile --dataset $MT --num-prompts 1 --max-new-tokens 32 --device cuda --dtype float32 --modes dart --budget 60 --top-ops 12 --no-progress" ;;
    # a batch of 16 prompts stepped together, autoregressive and DART at a fixed budget (which always drafts), and
    # the steps of a speculative engine whose gate keeps speculation off (gated-off: their cost against autoregressive)
    prof16-bf16) cmd="dart_core.bench.step_profile --dataset $MT --num-prompts 16 --batch-size 16 --max-new-tokens 32 --device cuda --dtype bfloat16 --budget 16 --modes autoregressive dart gated-off --no-progress" ;;
    # the same batch of 16 with the 12 host operators and CUDA kernels that take the most time per step: where a
    # step's kernel time and a gated-off step's extra host time go
    ops16-bf16) cmd="dart_core.bench.step_profile --dataset $MT --num-prompts 16 --batch-size 16 --max-new-tokens 32 --device cuda --dtype bfloat16 --budget 16 --modes autoregressive dart gated-off --top-ops 12 --no-progress" ;;
    # the same batch, autoregressive against gated-off steps, with the 25 Python functions taking the most self time
    # under cProfile: the host time of a gated-off step that no PyTorch operator accounts for
    py16-bf16) cmd="dart_core.bench.step_profile --dataset $MT --num-prompts 16 --batch-size 16 --max-new-tokens 32 --device cuda --dtype bfloat16 --budget 16 --modes autoregressive gated-off --top-python 25 --no-progress" ;;
    # structured output (needs llguidance: its wheel unzipped into /tmp/site)
    struct-bf16) cmd="dart_core.bench.structured --device cuda --dtype bfloat16 --max-tokens ${STRUCT_TOKENS:-128} --runs ${STRUCT_RUNS:-1}" ;;
    # one client, 4 requests of 128 tokens on the tuning set (AlpacaEval, carried as alpacaeval.jsonl), with the
    # engine's debug log: the speculation gate's choice and measurement at every step (in the job's log)
    gate-bf16)  cmd="dart_core.bench.batching --concurrency 1 --requests-per-client 4 --max-tokens 128 --dataset $D/files/extra/alpacaeval.jsonl --device cuda --dtype bfloat16 --no-progress --log-level debug" ;;
    batch-bf16) cmd="dart_core.bench.batching --concurrency 1 4 16 64 --requests-per-client 1 --max-tokens 64 --dataset $MT --device cuda --dtype bfloat16 --no-progress" ;;
    *) echo "unknown job $job"; continue ;;
  esac
  variant=${variant//+/-}  # in names: nogate-old
  name=$job${variant:+-$variant}
  env "${envs[@]}" timeout ${JOB_TIMEOUT:-600} python3 -m $cmd $graphs $extra --out $R/b/$name > $R/rep/logs/$name.log 2>&1
  rc=$?
  label=${job#*-}${variant:+-$variant}; kind=${job%%-*}
  case $kind in
    dec) f=decoding;; prof) f=step_profile;; ops) f=step_profile; label=ops-$label;; batch) f=batching;;
    prof16) f=step_profile; label=b16-$label;; ops16) f=step_profile; label=ops-b16-$label;;
    py16) f=step_profile; label=py-b16-$label;; struct) f=structured;; gate) f=batching; label=gate-$label;;
  esac
  dest=$R/rep/$f-$label  # a repeated job: its runs are named -run1, -run2, ... (gpu_report takes their median)
  if [ -f $dest.json ]; then mv $dest.json $dest-run1.json; fi
  if [ -f $dest-run1.json ]; then n=$(ls $dest-run*.json | wc -l); dest=$dest-run$((n + 1)); fi
  [ -f $R/b/$name/$f.json ] && cp $R/b/$name/$f.json $dest.json
  tar -czf $RET/rep.tgz -C $R rep  # what has come so far travels back even if a later job runs past the limit
  echo "[$(date +%T)] $name rc=$rc $(( $(date +%s) - t0 )) s"; tail -4 $R/rep/logs/$name.log | cut -c1-300
done
