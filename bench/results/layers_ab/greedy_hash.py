"""Greedy output of the decoding bench's first 4 MT-Bench and HumanEval prompts, 128 tokens, hashed."""
import hashlib, json, sys
from dart_core.api import DartModel
from dart_core.bench.datasets import load_prompts
m = DartModel.from_pretrained()
out = {}
for ds in ("mt-bench", "humaneval"):
    prompts = load_prompts(ds, 4)
    ids = [m.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"] for p in prompts]
    for spec in (True, False):
        r = m.engine.generate(ids, m.sampling_params(max_new_tokens=128), speculative=spec)
        out[f"{ds}-{'dart' if spec else 'ar'}"] = hashlib.sha256(json.dumps(r.token_ids).encode()).hexdigest()[:16]
print(json.dumps(out))
