"""A restart with a snapshot keeps τ on repeated requests, served.
``python bench/results/live_corpus_served/restart_bench.py [N] [passes]`` (from the repository root).

Per pass: ``serve run deployments/dart.yaml`` with ``ngram.learn_snapshot`` set to a fresh file
answers N tuning-split prompts (first-seen: their outputs are learned), waits past the service's
one-minute snapshot period (so the file is written whether or not the shutdown writes it too) and
is stopped; a new ``serve run`` with the same file reloads it and answers the same N prompts again
(repeats after the restart). A third server with ``ngram.learn: false`` answers them once (the
repeats' baseline). One client, T = 0, 128 tokens; prints one JSON object per pass; every repeat's
text must equal its first answer.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml
from openai import OpenAI

from dart_core.bench import traffic
from dart_core.bench.report import launch_app
from dart_core.bench.tune_context import tuning_conversations

n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
passes = int(sys.argv[2]) if len(sys.argv) > 2 else 3
cfg = traffic.TrafficConfig(serve=True)
prompts = [c[0]["content"][:1500] for c in tuning_conversations(n, seed=7)]
client = OpenAI(base_url=cfg.url, api_key="unused", max_retries=0, timeout=cfg.timeout_s)
log = Path(tempfile.gettempdir()) / "dart-restart-serve.log"
ngram = yaml.safe_load(Path(cfg.config).read_text())["applications"][0]["args"]["ngram"]


def answer(learn: bool):
    model = client.models.list().data[0].id
    traffic._warm_up(client, model, cfg)
    return [traffic._request(client, model, p, cfg, speculative=True, learn=learn) | {"kind": "first"}
            for p in prompts]


def summary(records):
    s = traffic.summarise(records)["all"]
    return {"tau": s["tau"], "decode_tokens_per_s": round(s["decode_tokens_per_s"], 1)}


for p in range(passes):
    snap = os.path.join(tempfile.mkdtemp(), "live.snap")
    runs = {}
    for name, update, learn in (("first", {"learn_snapshot": snap}, True),
                                ("after restart", {"learn_snapshot": snap}, True),
                                ("learning off", {"learn": False}, False)):
        with launch_app(None, timeout_s=600.0, log=log, args={"ngram": {**ngram, **update}}):
            runs[name] = answer(learn)
            if name == "first":
                time.sleep(65)
    assert [r["text"] for r in runs["after restart"]] == [r["text"] for r in runs["first"]]
    print(json.dumps({"pass": p, "snapshot_bytes": os.path.getsize(snap)} | {k: summary(v) for k, v in runs.items()}),
          flush=True)
