"""Tree-search ms and page faults per search in a fresh process, the page cache dropped first.

Run as root (it writes /proc/sys/vm/drop_caches):  python search_faults.py [label]
Decodes the first 4 MT-Bench prompts (128 tokens, T = 0) with DartModel.from_pretrained()
defaults and times every tree search, with the minor and major page faults it took.
"""
import json
import resource
import subprocess
import sys
import time

subprocess.run("sync; echo 1 > /proc/sys/vm/drop_caches", shell=True, check=True)

import torch  # noqa: E402

from dart_core.api import DartModel  # noqa: E402
from dart_core.bench.datasets import load_prompts  # noqa: E402

torch.set_num_threads(2)
model = DartModel.from_pretrained(None)
engine = model.engine
search = engine.tree_search.search_batch
records = []


def timed(*args, **kwargs):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = search(*args, **kwargs)
    ms, r1 = 1e3 * (time.perf_counter() - t0), resource.getrusage(resource.RUSAGE_SELF)
    records.append((ms, r1.ru_minflt - r0.ru_minflt, r1.ru_majflt - r0.ru_majflt))
    return out


engine.tree_search.search_batch = timed
for text in load_prompts("mt-bench", 4):
    list(engine.generate_stream([model.encode([{"role": "user", "content": text}])],
                                model.sampling_params(max_new_tokens=128)))
ms = sorted(r[0] for r in records)
print(json.dumps({"label": sys.argv[1] if len(sys.argv) > 1 else "", "searches": len(records),
                  "median_ms": round(ms[len(ms) // 2], 3), "max_ms": round(ms[-1], 2),
                  "searches_over_5ms": sum(m > 5 for m in ms), "major_faults": sum(r[2] for r in records),
                  "minor_faults": sum(r[1] for r in records), "search_ms_total": round(sum(ms), 1)}))
