"""Batch-1 A/B of the folding in one process: the shipped defaults without the gate (as the
decoding benchmark runs them), 4 HumanEval prompts x 128 tokens, DartEngine.fold_width None (hold
everything until the next draft) against 15, alternating, 6 passes each; tokens/s per pass and the
median, and whether the outputs are equal.  Run: python bench/results/held_fold/batch1_ab.py
(load_prompts("mt-bench") for the MT-Bench pass)."""
import time, statistics, torch
torch.set_num_threads(2)
from dart_core.api import DartModel
from dart_core.bench.datasets import load_prompts
from dart_core.sampling import SamplingParams
m = DartModel.from_pretrained(None, budget="auto")
eng, tok = m.engine, m.tokenizer
eng.gate = None
prompts = load_prompts("humaneval")[:4]
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
ids = [x if isinstance(x, list) else x["input_ids"] for x in ids]
sp = SamplingParams(max_new_tokens=128)
res = {None: [], 15: []}
outs = {}
for rep in range(6):
    for fw in ((None, 15) if rep % 2 == 0 else (15, None)):
        eng.fold_width = fw
        t0 = time.perf_counter(); n = 0
        for i, p in enumerate(ids):
            r = eng.generate([p], sp)
            n += len(r.token_ids[0]); outs.setdefault((fw, i), r.token_ids[0])
        res[fw].append(n / (time.perf_counter() - t0))
print({k: [round(x, 1) for x in v] for k, v in res.items()})
print({k: round(statistics.median(v), 1) for k, v in res.items()})
print("equal outputs:", all(outs[(None, i)] == outs[(15, i)] for i in range(len(ids))))
