import os, subprocess, sys, time, statistics
import numpy as np, torch
from ngram_service.client import GrpcTreeSearch, InProcessTreeSearch
from ngram_service.trie import NgramTrie
from ngram_service.tree_search import SearchParams
trie = os.path.expanduser("~/.cache/dart-serve/tries/SmolLM2-135M-Instruct-default-3gram.trie")
srv = subprocess.Popen([sys.executable, "-m", "ngram_service.server", "--trie", trie, "--port", "50072", "--threads", "1"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
while "serving on" not in srv.stdout.readline(): pass
t = NgramTrie(trie)
local = InProcessTreeSearch(t, threads=1)
remote = GrpcTreeSearch("127.0.0.1:50072", timeout_ms=500, vocab_hash=t.info.vocab_hash)
rng = np.random.default_rng(0)
d, k = 8, 8
ids = rng.integers(0, 40000, (1, d, k)).astype(np.int64); probs = np.sort(rng.random((1, d, k)).astype(np.float32), -1)[..., ::-1].copy()
ctx = [rng.integers(0, 40000, 50).astype(np.int64)]
params = SearchParams(budget=8) if "budget" in SearchParams.__dataclass_fields__ else SearchParams()
print(params)
a = torch.randn(576, 576); b = torch.randn(576, 1536)
def timeit(client, work):
    out = []
    for i in range(300):
        if work: (a @ b).sum()
        t0 = time.perf_counter(); client.search_batch(ids, probs, ctx, params); out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out[50:])
for r in range(2):
    for name, c in (("local", local), ("remote", remote)):
        for work in (False, True):
            print(name, "after torch op" if work else "idle", round(timeit(c, work), 3))
srv.terminate()
