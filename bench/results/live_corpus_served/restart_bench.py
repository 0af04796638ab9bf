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
import time
import statistics
import sys
import tempfile
from pathlib import Path

import yaml
from openai import OpenAI

from dart_core.bench import traffic
from dart_core.bench.tune_context import tuning_conversations

n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
passes = int(sys.argv[2]) if len(sys.argv) > 2 else 3
cfg = traffic.TrafficConfig(serve=True)
prompts = [c[0]["content"][:1500] for c in tuning_conversations(n, seed=7)]
client = OpenAI(base_url=cfg.url, api_key="unused", max_retries=0, timeout=cfg.timeout_s)
log = Path(tempfile.gettempdir()) / "dart-restart-serve.log"


def serve(config_update: dict, learn: bool):
    doc = yaml.safe_load(Path(cfg.config).read_text())
    doc["applications"][0]["args"]["ngram"].update(config_update)
    path = Path(tempfile.mkdtemp()) / "dart.yaml"
    path.write_text(yaml.safe_dump(doc))
    return traffic._Server(str(path), learn, cfg.url, log)


def answer(server, learn: bool):
    model = server.wait(client)
    traffic._warm_up(client, model, cfg)
    return [traffic._request(client, model, p, cfg, speculative=True, learn=learn) for p in prompts]


def summary(records):
    taus = [r["tau"] for r in records if r["tau"] is not None]
    return {"tau": round(statistics.mean(taus), 3),
            "decode_tokens_per_s": round(sum(r["tokens"] - 1 for r in records) / sum(r["decode_seconds"] for r in records), 1)}


for p in range(passes):
    snap = os.path.join(tempfile.mkdtemp(), "live.snap")
    runs = {}
    for name, update, learn in (("first", {"learn_snapshot": snap}, True),
                                ("after restart", {"learn_snapshot": snap}, True),
                                ("learning off", {"learn": False}, False)):
        server = serve(update, learn)
        try:
            runs[name] = answer(server, learn)
            if name == "first":
                time.sleep(65)
        finally:
            server.stop()
    assert [r["text"] for r in runs["after restart"]] == [r["text"] for r in runs["first"]]
    print(json.dumps({"pass": p, "snapshot_bytes": os.path.getsize(snap)} | {k: summary(v) for k, v in runs.items()}),
          flush=True)
