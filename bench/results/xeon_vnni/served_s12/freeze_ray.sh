#!/usr/bin/env bash
# The engine in process (in_process.py: 16 MT-Bench requests, 128 tokens, no speculation) beside an idle
# `serve run deployments/dart.yaml`, alternately with every Ray process running and with them all stopped
# (SIGSTOP, then SIGCONT): what the idle serving stack costs an engine on the same two cores.
RAYPIDS=$(pgrep -f "ray::|gcs_server|raylet|dashboard|serve run|log_monitor|monitor.py|runtime_env" | tr '\n' ' ')
for r in 1 2; do
  for mode in idle stopped; do
    [ $mode = stopped ] && kill -STOP $RAYPIDS
    python "$(dirname "$0")/in_process.py" no 16 2>&1 | tail -1 | sed "s/^/$mode /"
    [ $mode = stopped ] && kill -CONT $RAYPIDS
    sleep 2
  done
done
