"""First look at the live corpus (in process): exact repeats of tuning-split requests, τ and tokens/s
with learning on and off.  ``python bench/results/live_corpus_first_look/repeat_bench.py [N] [passes]``.

Prompts: the first user turns of N ShareGPT conversations from the tuning pool
(``dart_core.bench.tune_context.tuning_conversations``), never the benchmark sets.  Per pass, with the
shipped defaults (adaptive budget, gate off as the decoding benchmark runs it):
  off:   every prompt once, then every prompt again, no live corpus;
  on:    the same with a live corpus that learns each finished output (what a served engine sends);
  and every prompt once without speculation (autoregressive), the baseline of the speed-ups.
Prints one JSON object per pass and mode.
"""

import json
import sys
import time

from dart_core.api import DartModel
from dart_core.bench.tune_context import tuning_conversations
from ngram_service.client import InProcessTreeSearch
from ngram_service.live import LiveCorpus

n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
passes = int(sys.argv[2]) if len(sys.argv) > 2 else 3
m = DartModel.from_pretrained()
m.engine.gate = None
trie = m.engine.tree_search.trie
prompts = [m.tokenizer.apply_chat_template([c[0]], add_generation_prompt=True, tokenize=True, return_dict=True)
           ["input_ids"] for c in tuning_conversations(n, seed=1)]
sp = m.sampling_params(max_new_tokens=128)


def run(ids, learn_to):
    t0 = time.perf_counter()
    r = m.engine.generate([ids], sp)
    dt = time.perf_counter() - t0
    if learn_to is not None:
        learn_to.learn([r.token_ids[0]])
    return r, dt


for p in range(passes):
    t0 = time.perf_counter()
    ar = [m.engine.generate([ids], sp, speculative=False) for ids in prompts]
    print(json.dumps({"pass": p, "mode": "autoregressive", "tokens_per_s": round(
        sum(len(r.token_ids[0]) for r in ar) / (time.perf_counter() - t0), 1)}), flush=True)
    for mode in (("off", "on") if p % 2 == 0 else ("on", "off")):
        live = LiveCorpus() if mode == "on" else None
        m.engine.tree_search = InProcessTreeSearch(trie, live=live)
        learner = m.engine.tree_search if live is not None else None
        first = [run(ids, learner) for ids in prompts]
        again = [run(ids, None) for ids in prompts]
        assert [a.token_ids for a, _ in again] == [f.token_ids for f, _ in first]  # lossless
        out = {"pass": p, "mode": mode}
        for name, rs in (("first", first), ("repeat", again)):
            toks = sum(len(r.token_ids[0]) for r, _ in rs)
            out[name] = {"tokens_per_s": round(toks / sum(dt for _, dt in rs), 1),
                         "tau": round(sum(r.emitted_after_prefill for r, _ in rs) /
                                      max(1, sum(r.sequence_steps for r, _ in rs)), 3)}
        if live is not None:
            st = live.stats()
            out["live"] = {"tokens": st.tokens, "bytes": st.bytes, "hit_rate": round(st.hit_rate, 3)}
        print(json.dumps(out), flush=True)
