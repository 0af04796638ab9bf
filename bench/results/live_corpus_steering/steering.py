"""Does a live corpus full of other traffic steer first-seen drafts the wrong way?  In process.

``python bench/results/live_corpus_steering/steering.py [N_OTHER] [passes]``

Other traffic: the first user turns of ``N_OTHER`` ShareGPT conversations from the tuning pool
(``tuning_conversations(N_OTHER, seed=5)``), answered greedily by the target (128 tokens,
autoregressive), each answer learned into a :class:`~ngram_service.live.LiveCorpus` as a served
engine sends it (outputs only, the shipped ``learn_prompts: false``).

First-seen requests: the first 8 prompts of MT-Bench and of HumanEval (the benchmark sets:
reported here, nothing is tuned on them), 128 tokens, T = 0, shipped defaults.  Per pass, the
same requests with the tree search reading the filled corpus (``filled``) and without a live
corpus (``empty``: learning off), the order alternating; nothing is learned while they run.
Prints one JSON object per pass, set and mode (τ and tokens/s), and checks that the outputs are
equal across modes and passes (lossless).
"""

import json
import sys
import time

from dart_core.api import DartModel
from dart_core.bench.datasets import load_prompts
from dart_core.bench.tune_context import tuning_conversations
from ngram_service.client import InProcessTreeSearch
from ngram_service.live import LiveCorpus

n_other = int(sys.argv[1]) if len(sys.argv) > 1 else 160
passes = int(sys.argv[2]) if len(sys.argv) > 2 else 3
m = DartModel.from_pretrained()
trie = m.engine.tree_search.trie
sp = m.sampling_params(max_new_tokens=128)


def chat_ids(text):
    return m.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]


filled = LiveCorpus()
t0 = time.perf_counter()
for c in tuning_conversations(n_other, seed=5):
    r = m.engine.generate([chat_ids(c[0]["content"])], sp, speculative=False)
    filled.add([r.token_ids[0]])
st = filled.stats()
print(json.dumps({"other_traffic": {"requests": n_other, "tokens": st.tokens, "bytes": st.bytes,
                                    "seconds": round(time.perf_counter() - t0, 1)}}), flush=True)

sets = {name: [chat_ids(p) for p in load_prompts(name, 8)] for name in ("mt-bench", "humaneval")}
outputs = {}
for p in range(passes):
    for mode in (("empty", "filled") if p % 2 == 0 else ("filled", "empty")):
        m.engine.tree_search = InProcessTreeSearch(trie, live=filled if mode == "filled" else None)
        for name, prompts in sets.items():
            t0 = time.perf_counter()
            rs = [m.engine.generate([ids], sp) for ids in prompts]
            dt = time.perf_counter() - t0
            toks = [r.token_ids[0] for r in rs]
            assert outputs.setdefault(name, toks) == toks  # lossless: the same text in every mode and pass
            print(json.dumps({"pass": p, "mode": mode, "set": name,
                              "tokens_per_s": round(sum(map(len, toks)) / dt, 1),
                              "tau": round(sum(r.emitted_after_prefill for r in rs) /
                                           max(1, sum(r.sequence_steps for r in rs)), 3)}), flush=True)
    print(json.dumps({"pass": p, "filled_hit_rate": round(filled.stats().hit_rate, 3)}), flush=True)
