import sys, json, statistics
from openai import OpenAI
from dart_core.bench.serving import ServingConfig, _level
from dart_core.bench.datasets import load_prompts
from dart_core.bench.traffic import engine_stats
cfg = ServingConfig(concurrency=[8], requests_per_client=2, max_tokens=128)
client = OpenAI(base_url=cfg.url, api_key="unused", max_retries=0, timeout=600)
model = client.models.list().data[0].id
prompts = load_prompts(cfg.dataset)
def snap():
    s = engine_stats("dart") or {}
    return s.get("speculative_steps", 0), s.get("autoregressive_steps", 0), s.get("gate"), s.get("ngram_calls")
res = {"dart": [], "no-speculation": []}
for r in range(int(sys.argv[1])):
    for m in (["dart", "no-speculation"] if r % 2 == 0 else ["no-speculation", "dart"]):
        a = snap()
        row = _level(client, model, prompts, 8, m, cfg)
        b = snap()
        res[m].append(row["tokens_per_s"])
        print(r, m, row["tokens_per_s"], "ttft", row["ttft_ms"]["p50"], "spec steps", b[0] - a[0], "ar steps", b[1] - a[1], "ngram calls", (b[3] or 0) - (a[3] or 0), flush=True)
print("pairs", [round(x / y, 3) for x, y in zip(res["dart"], res["no-speculation"])])
print(json.dumps(snap()[2]))
