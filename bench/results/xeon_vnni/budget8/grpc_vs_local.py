"""In process, budget 8: the engine's tree search local (InProcessTreeSearch) vs over gRPC to a
standalone n-gram server on the same machine (no Ray). Alternating, 3 rounds, 4 MT-Bench prompts."""
import time, statistics, sys
from dart_core.api import DartModel
from dart_core.bench.datasets import load_prompts
from ngram_service.client import GrpcTreeSearch
m = DartModel.from_pretrained(budget=8)
local = m.engine.tree_search
remote = GrpcTreeSearch(sys.argv[1], timeout_ms=1000, vocab_hash="", auth_token="devtoken")
prompts = load_prompts("mt-bench")[:4]
def run(ts):
    m.engine.tree_search = ts
    steps = []
    t0 = time.perf_counter(); n = 0
    for p in prompts:
        for chunk in m.engine.generate_stream([m.encode([{"role": "user", "content": p}])], m.sampling_params(max_new_tokens=128)):
            steps.append((chunk.draft_ms, chunk.tree_search_ms, chunk.verify_ms, chunk.step_ms))
            n += sum(len(t) for t in chunk.new_tokens)
    dt = time.perf_counter() - t0
    med = [round(statistics.median(x[i] for x in steps[1:]), 2) for i in range(4)]
    return round(n / dt, 1), med
run(local)
for r in range(3):
    for name, ts in (("local", local), ("grpc", remote)):
        print(r, name, *run(ts), "fallbacks", remote.fallbacks, flush=True)
