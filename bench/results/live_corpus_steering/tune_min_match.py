"""Tunes ``LiveCorpus.min_match`` on the tuning split, in process.

``python bench/results/live_corpus_steering/tune_min_match.py [passes] [SETTING ...]``

A setting is ``MIN_MATCH`` (``max_context`` 4, the corpus's before this study) or
``MAX_CONTEXT:MIN_MATCH``, with a trailing ``c`` for the shipped chain choice (the corpus's chain
replaces the request's own only if its match, counted at most as ``REQUEST_MATCH_CAP`` = 4 tokens,
is longer); without it, the choice before this study (any longer match wins); 0 is no corpus.
Default: 0 1 2 3 4.

The live corpus holds other traffic: the target's greedy answers (128 tokens, autoregressive) to the
first user turns of 160 ShareGPT conversations of the tuning pool (``tuning_conversations(160,
seed=5)``, as ``steering.py``).  Measured with each ``min_match`` (and without a corpus: 0):

- ``first``: the first 16 AlpacaEval prompts (the tuning set), never answered before;
- ``repeat``: 8 of the other-traffic prompts again (exact repeats: their answers are in the corpus).

128 tokens, T = 0, the shipped defaults except the speculation gate (off, so that every step
drafts and τ compares the drafts alone).  Settings in a rotating order per pass; outputs checked
equal across settings (lossless).  One JSON object per pass, setting and class.
"""

import json
import sys
import time

from dart_core.api import DartModel
from dart_core.bench.datasets import load_prompts
from dart_core.bench.tune_context import tuning_conversations
from ngram_service.client import InProcessTreeSearch
from ngram_service import live as ngram_live
from ngram_service.live import LiveCorpus
from ngram_service.tree_search import ContextChain

passes = int(sys.argv[1]) if len(sys.argv) > 1 else 2
settings = sys.argv[2:] or ["0", "1", "2", "3", "4"]
m = DartModel.from_pretrained()
m.engine.gate = None
trie = m.engine.tree_search.trie
shipped_rule = ngram_live.prefer_longer_match
sp = m.sampling_params(max_new_tokens=128)


def chat_ids(text):
    return m.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]


other = [chat_ids(c[0]["content"]) for c in tuning_conversations(160, seed=5)]
answers = [m.engine.generate([ids], sp, speculative=False).token_ids[0] for ids in other]
classes = {"first": [chat_ids(p) for p in load_prompts("alpacaeval", 16)], "repeat": other[:8]}


def uncapped(chains, live, max_len):
    """The chain choice before this study: the corpus's chain wherever it matched a longer suffix
    than the request's own, at any length."""
    own = list(chains) if chains is not None else [None] * len(live)
    out = []
    for c, lv in zip(own, live):
        if len(lv.tokens) and (c is None or not len(c.tokens) or lv.match_length > c.match_length):
            c = ContextChain(lv.tokens[:max_len], lv.probs[:max_len], lv.match_length)
        out.append(c)
    return out


def corpus_for(setting: str) -> LiveCorpus | None:
    ngram_live.prefer_longer_match = shipped_rule if setting.endswith("c") else uncapped
    setting = setting.rstrip("c")
    order, _, least = setting.rpartition(":")
    if least == "0":
        return None
    corpus = LiveCorpus(max_context=int(order or 4), min_match=int(least))
    corpus.add(answers)
    return corpus


outputs = {}
for p in range(passes):
    for setting in settings[p % len(settings):] + settings[:p % len(settings)]:
        m.engine.tree_search = InProcessTreeSearch(trie, live=corpus_for(setting))
        for name, prompts in classes.items():
            t0 = time.perf_counter()
            rs = [m.engine.generate([ids], sp) for ids in prompts]
            dt = time.perf_counter() - t0
            toks = [r.token_ids[0] for r in rs]
            assert outputs.setdefault(name, toks) == toks
            print(json.dumps({"pass": p, "setting": setting, "class": name,
                              "tokens_per_s": round(sum(map(len, toks)) / dt, 1),
                              "tau": round(sum(r.emitted_after_prefill for r in rs) /
                                           max(1, sum(r.sequence_steps for r in rs)), 3)}), flush=True)
