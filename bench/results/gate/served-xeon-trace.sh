#!/usr/bin/env bash
# How served-xeon-alpacaeval-N.log were recorded (2-core Intel Xeon, AVX-512 VNNI, no BF16; 2026-11-30):
# a fresh `serve run deployments/dart.yaml` per log, one client, 16 AlpacaEval instructions (the tuning set),
# 128 tokens, DART only.  The engine replica wrote its gated-step DEBUG lines (dart_core.step.engine.GATE_LOG)
# to a file of its own and not to the Serve console, through this hook, appended for the run to
# deployments/logs.py and not committed:
#
#   import os as _os
#   if _os.environ.get("DART_GATE_TRACE"):
#       _h = logging.FileHandler(_os.environ["DART_GATE_TRACE"] + f".{_os.getpid()}")
#       _h.setFormatter(logging.Formatter("%(created).4f %(message)s"))
#       _l = logging.getLogger("dart_core.step.engine")
#       _l.addHandler(_h); _l.setLevel(logging.DEBUG); _l.propagate = False
#
# (`logging_config: {log_level: DEBUG}` gives the same lines in the replica log, but every line also travels to
# the `serve run` console, which on two cores cut one client's tokens/s to about a quarter.)
# usage: served-xeon-trace.sh OUT
set -e
cd "$(git rev-parse --show-toplevel)"
pkill -f "serve run" || true; ray stop --force >/dev/null 2>&1 || true; sleep 2
DART_GATE_TRACE=/tmp/$1.gate nohup serve run deployments/dart.yaml > /tmp/$1.serve.log 2>&1 &
for i in $(seq 1 60); do sleep 5; grep -q "DART engine ready" /tmp/$1.serve.log && break; done; sleep 5
python -m dart_core.bench.serving --concurrency 1 --repeats 1 --max-tokens 128 --requests-per-client 16 \
    --modes dart --dataset alpacaeval --no-progress --out /tmp/$1
pkill -f "serve run"; ray stop --force >/dev/null 2>&1
