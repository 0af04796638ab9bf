"""The microbenchmark of README.md ("What the batched form saves per call"): the adaptive budget's
selection, the depth cut, the search and the packing, per tree (main) against batched (after).

    git show 568c64d:dart_core/budget.py > /tmp/old_budget.py
    python bench/results/host_only_b16_batched/tree_ops_micro.py /tmp/old_budget.py
"""

import importlib.util
import sys
import timeit

import numpy as np
import torch

from dart_core.budget import AdaptiveBudget, VerifyCostCurve
from dart_core.drafters import DraftBatch
from ngram_service.tree_search import SearchParams, search_tree_batch, search_trees

spec = importlib.util.spec_from_file_location("old_budget", sys.argv[1])
old = importlib.util.module_from_spec(spec)
sys.modules["old_budget"] = old
spec.loader.exec_module(old)


def us(f, n=200):
    return 1e6 * min(timeit.repeat(f, number=n, repeat=5)) / n


rng = np.random.default_rng(0)
for b, budget in ((16, 16), (16, 60), (1, 60)):
    ids = rng.integers(0, 1000, (b, 8, 25))
    probs = np.sort(rng.dirichlet(np.ones(25), (b, 8)).astype(np.float32), -1)[..., ::-1].copy()
    contexts = [rng.integers(0, 1000, 5) for _ in range(b)]
    params = SearchParams(budget=budget, use_ngram=False)
    batch = search_tree_batch(ids, probs, contexts, params=params)
    trees = search_trees(ids, probs, contexts, params=params)
    new = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 40.0)))
    main = old.AdaptiveBudget(old.VerifyCostCurve((1, 64), (10.0, 40.0)))
    cut = np.full(b, 2)
    print(f"batch {b}, {batch.num_nodes} nodes:",
          f"budget per tree {us(lambda: main.select_batch(trees)):.0f}, batched {us(lambda: new.select_batch(batch)):.0f};",
          f"packed per tree {us(lambda: main.select_batch(trees, packed=True)):.0f},",
          f"batched {us(lambda: new.select_batch(batch, packed=True)):.0f};",
          f"clip per tree {us(lambda: [t.clip_depth(2) for t in trees]):.0f}, batched {us(lambda: batch.clip_depth(cut)):.0f};",
          f"search_trees {us(lambda: search_trees(ids, probs, contexts, params=params), 50):.0f},",
          f"search_tree_batch {us(lambda: search_tree_batch(ids, probs, contexts, params=params), 50):.0f};",
          f"pack {us(lambda: DraftBatch.pack(batch, torch.device('cpu'))):.0f} µs")
