#!/bin/bash
# In process, the engine's autoregressive step at batch 1 with 1 or 2 PyTorch threads, alone or beside a
# synthetic neighbour taking ~40 % of one core; engine and neighbour at niceness 15, as Ray runs its workers.
# 3 rounds, the settings alternating; one step_profile line per run.  Usage: bash contention.sh > contention.txt
cd "$(git rev-parse --show-toplevel)"
here=bench/results/xeon_vnni/served_s15
for round in 1 2 3; do
  for threads in 2 1; do
    for load in none 0.4; do
      [ "$load" != none ] && { nice -n 15 python $here/busy_load.py $load & lp=$!; }
      line=$(nice -n 15 python -m dart_core.bench.step_profile --batch-size 1 --modes autoregressive --repeats 3 \
             --threads $threads --no-progress --out /tmp/contention 2>&1 | grep "^| autoregressive")
      [ "$load" != none ] && kill $lp
      echo "round $round, threads $threads, neighbour $load: $line"
    done
  done
done
