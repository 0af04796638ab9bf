"""Writes unseen.jsonl: a repetitive workload no setting was tuned on.

The built workload's families use TEMPLATES[0..3] with slots drawn at seed 0; this one keeps only
the two templates no run has used (TEMPLATES[4], [5]), slots and repeated prompts from the tuning
split drawn at seed 11, shuffled at seed 11.
"""
import json
from pathlib import Path

from dart_core.bench.traffic import build_workload

items = [r for r in build_workload(families=6, variants=4, repeated=6, repeat_times=3, seed=11)
         if r["family"] not in {f"template-{i}" for i in range(4)}]
out = Path(__file__).with_name("unseen.jsonl")
out.write_text("".join(json.dumps({"prompt": r["prompt"], "family": r["family"]}) + "\n" for r in items))
print(len(items), "requests ->", out)
