"""EAGLE-3 drafts sized by the adaptive budget (``Eagle3Drafter.tree_size``) against drafts of the
drafter's full size, in process, batch 1.

``python bench/results/eagle3_sized/sized.py HEAD [passes] [prompts]``

HEAD is an EAGLE-3 head folder for the embedded SmolLM2-135M-Instruct.  Modes, in a rotating order
per pass, each with a fresh adaptive budget on the verification cost curve measured at start (as
``python -m dart_core.bench --methods eagle3`` builds it; no speculation gate, so every step drafts):

- ``sized``: the shipped drafter, each draft sized to what the budget keeps;
- ``full``: the same drafter with no budget of its own (every draft at the reference's 60 nodes,
  depth 7, top-k 10; the engine's budget still selects the verified nodes);
- ``autoregressive``: the target alone.

The first ``prompts`` MT-Bench and HumanEval prompts (default 8), 128 new tokens, T = 0; outputs
checked equal to autoregressive decoding.  One JSON object per pass, mode and dataset: tokens/s,
τ, draft ms per speculative step.
"""

import json
import sys
import time

from dart_core.api import DartModel, eagle3_drafter
from dart_core.bench.datasets import load_prompts
from dart_core.spec.budget import AdaptiveBudget
from dart_core.step.engine import DartEngine

head_dir = sys.argv[1]
passes = int(sys.argv[2]) if len(sys.argv) > 2 else 3
limit = int(sys.argv[3]) if len(sys.argv) > 3 else 8
m = DartModel.from_pretrained()
target, curve = m.engine.target, m.engine.budget.curve
sp = m.sampling_params(max_new_tokens=128)
drafter = eagle3_drafter(head_dir, target)


def ids(text):
    return m.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]


sets = {name: [ids(p) for p in load_prompts(name, limit)] for name in ("mt-bench", "humaneval")}
modes = ["sized", "full", "autoregressive"]
want = {name: [m.engine.generate([p], sp, speculative=False).token_ids[0] for p in ps] for name, ps in sets.items()}
for p in range(passes):
    for mode in modes[p % 3:] + modes[:p % 3]:
        budget = AdaptiveBudget(curve)
        drafter.budget = budget if mode == "sized" else None
        engine = DartEngine(target, drafter=drafter, budget=budget)
        for name, prompts in sets.items():
            rs, t0 = [], time.perf_counter()
            for x in prompts:
                rs.append(engine.generate([x], sp, speculative=mode != "autoregressive"))
            dt = time.perf_counter() - t0
            assert [r.token_ids[0] for r in rs] == want[name], (mode, name)
            steps = sum(r.target_forwards for r in rs)
            print(json.dumps({"pass": p, "mode": mode, "dataset": name,
                              "tokens_per_s": round(sum(len(r.token_ids[0]) for r in rs) / dt, 1),
                              "tau": round(sum(r.emitted_after_prefill for r in rs) / max(1, sum(r.sequence_steps
                                                                                            for r in rs)), 3),
                              "draft_ms_per_step": round(sum(r.phase_ms["draft"] for r in rs) / max(1, steps), 2)}),
                  flush=True)
