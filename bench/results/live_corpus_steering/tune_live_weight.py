"""Tunes the live corpus's weight in the tree search on the tuning split, in process, on traffic that
learns as it is served.

``python bench/results/live_corpus_steering/tune_live_weight.py [passes] [SETTING ...]``

A setting is a weight w (the corpus chain's per-token probabilities are multiplied by w before the
tree search weighs them with the context weight, so w = 1 is the shipped corpus before this study)
or ``none`` (no live corpus).  Default: none 1 0.5 0.25.

Traffic: the first user turns of 32 ShareGPT conversations of the tuning pool
(``tuning_conversations(32, seed=9)``), answered one after another: with a corpus, each answer is
learned once it is done, as a served engine sends it (outputs only), so later requests draft beside a
corpus of earlier, unrelated answers (``first``); then 8 of them again (``repeat``: their answers are
in the corpus).  128 tokens, T = 0, the shipped defaults except the speculation gate (off, so that
every step drafts and τ compares the drafts alone).  Settings in a rotating order per pass; outputs
checked equal across settings (lossless).  One JSON object per pass, setting and class; ``later``
is the second half of ``first`` (a corpus of 16 or more answers).
"""

import json
import sys
import time

import numpy as np

from dart_core.api import DartModel
from dart_core.bench.tune_context import tuning_conversations
from ngram_service import live as ngram_live
from ngram_service.client import InProcessTreeSearch
from ngram_service.live import LiveCorpus
from ngram_service.tree_search import ContextChain

passes = int(sys.argv[1]) if len(sys.argv) > 1 else 2
settings = sys.argv[2:] or ["none", "1", "0.5", "0.25"]
m = DartModel.from_pretrained()
m.engine.gate = None
trie = m.engine.tree_search.trie
shipped_rule = ngram_live.prefer_longer_match
sp = m.sampling_params(max_new_tokens=128)


def chat_ids(text):
    return m.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]


prompts = [chat_ids(c[0]["content"]) for c in tuning_conversations(32, seed=9)]
repeats = prompts[:8]


def weighted(w):
    def rule(chains, live, max_len):
        scaled = [ContextChain(lv.tokens, (np.asarray(lv.probs) * w).astype(np.float32), lv.match_length)
                  for lv in live]
        return shipped_rule(chains, scaled, max_len)
    return rule


outputs = {}
for p in range(passes):
    for setting in settings[p % len(settings):] + settings[:p % len(settings)]:
        corpus = None if setting == "none" else LiveCorpus()
        ngram_live.prefer_longer_match = shipped_rule if corpus is None else weighted(float(setting))
        m.engine.tree_search = InProcessTreeSearch(trie, live=corpus)
        for name, batch in (("first", prompts), ("repeat", repeats)):
            rs, t0 = [], time.perf_counter()
            for ids in batch:
                rs.append(m.engine.generate([ids], sp))
                if corpus is not None and name == "first":
                    corpus.add([rs[-1].token_ids[0]])
            dt = time.perf_counter() - t0
            toks = [r.token_ids[0] for r in rs]
            assert outputs.setdefault(name, toks) == toks
            groups = {name: rs} if name == "repeat" else {"first": rs, "later": rs[len(rs) // 2:]}
            for g, grs in groups.items():
                print(json.dumps({"pass": p, "setting": setting, "class": g,
                                  "tokens_per_s": round(sum(len(r.token_ids[0]) for r in grs) / dt, 1)
                                  if g != "later" else None,
                                  "tau": round(sum(r.emitted_after_prefill for r in grs) /
                                               max(1, sum(r.sequence_steps for r in grs)), 3)}), flush=True)
