"""Per pass at N clients against a running `serve run` (modes alternating): tokens/s, the engine's step
counters, and the CPU seconds each process used (from /proc, per pid, named by its title).

    python cpu_by_proc.py CLIENTS REPEATS
"""
import os, sys, time, collections
from openai import OpenAI
from dart_core.bench.serving import ServingConfig, _level
from dart_core.bench.datasets import load_prompts
from dart_core.bench.traffic import engine_stats

HZ = os.sysconf("SC_CLK_TCK")

def cpu():
    out = collections.Counter()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            name = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")[:60]
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            out[(pid, name.split(".")[0] or "?")] = (int(f[11]) + int(f[12])) / HZ
        except OSError:
            continue
    return out

n, repeats = int(sys.argv[1]), int(sys.argv[2])
cfg = ServingConfig(concurrency=[n], requests_per_client=2, max_tokens=128)
client = OpenAI(base_url=cfg.url, api_key="unused", max_retries=0, timeout=600)
model = client.models.list().data[0].id
prompts = load_prompts(cfg.dataset)
tot = {"dart": collections.Counter(), "no-speculation": collections.Counter()}
toks = {"dart": 0, "no-speculation": 0}
res = {"dart": [], "no-speculation": []}
for r in range(repeats):
    for m in (["dart", "no-speculation"] if r % 2 == 0 else ["no-speculation", "dart"]):
        s0 = engine_stats("dart") or {}
        a = cpu(); t0 = time.time()
        row = _level(client, model, prompts, n, m, cfg)
        wall = time.time() - t0; b = cpu()
        s1 = engine_stats("dart") or {}
        used = collections.Counter()
        for k in b:  # per process (pid) alive at both ends, by its title's first part
            if k in a:
                used[k[1]] += b[k] - a[k]
        tot[m].update(used); toks[m] += row["completion_tokens"]
        res[m].append(row["tokens_per_s"])
        top = ", ".join(f"{k}={v:.2f}" for k, v in used.most_common(5))
        print(r, m, row["tokens_per_s"], f"wall {wall:.1f}s", "spec", s1.get("speculative_steps", 0) - s0.get("speculative_steps", 0),
              "ar", s1.get("autoregressive_steps", 0) - s0.get("autoregressive_steps", 0), "|", top, flush=True)
print("pairs", [round(x / y, 3) for x, y in zip(res["dart"], res["no-speculation"])])
for m in tot:
    print(m, "CPU s per 1000 tokens:", ", ".join(f"{k}={1000 * v / toks[m]:.2f}" for k, v in tot[m].most_common(8)))
