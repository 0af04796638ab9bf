"""Does a tree search in another process (gRPC) slow the target's verification forward?

In process, fixed budget, AlpacaEval prompts (tuning set), T=0.  Modes alternate per round:
  inproc: InProcessTreeSearch with the default trie
  grpc:   GrpcTreeSearch to `python -m ngram_service.server` on the same trie (other process)
  ar:     speculative=False (autoregressive), with the server process alive
Per step: draft_ms, tree_search_ms, verify_ms, step_ms, and wall ms between steps.
"""
import os, subprocess, sys, time, statistics
from dart_core.api import DartModel
from dart_core.bench.datasets import load_prompts
from dart_core.model.tokenizer import tokenizer_identity
from ngram_service.client import GrpcTreeSearch

budget = int(os.environ.get("BUDGET", "8"))
rounds = int(os.environ.get("ROUNDS", "3"))
nprompts = int(os.environ.get("NPROMPTS", "4"))
modes = os.environ.get("MODES", "inproc grpc ar").split()
trie = os.path.expanduser("~/.cache/dart-serve/tries/SmolLM2-135M-Instruct-default-3gram.trie")
srv = subprocess.Popen([sys.executable, "-m", "ngram_service.server", "--trie", trie, "--port", "50071",
                        "--threads", os.environ.get("SRV_THREADS", "2")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
line = ""
while "serving on" not in line:
    line = srv.stdout.readline()
    if not line:
        raise SystemExit("server died")
m = DartModel.from_pretrained(budget=budget)
eng = m.engine
inproc = eng.tree_search
grpc_ts = GrpcTreeSearch("127.0.0.1:50071", timeout_ms=200, vocab_hash=tokenizer_identity(m.tokenizer)[1])
prompts = [m.encode(p) for p in load_prompts("alpacaeval", nprompts)]
from dart_core.step.sampling import SamplingParams
sp = SamplingParams(max_new_tokens=128)
res = {k: {"draft": [], "search": [], "verify": [], "step": [], "wall": [], "tok": 0, "fwd": 0, "t": 0.0} for k in modes}
outs = {}
eng.generate(prompts[:1], sp)  # warm
for r in range(rounds):
    order = modes[r % len(modes):] + modes[:r % len(modes)]
    for mode in order:
        eng.tree_search = grpc_ts if mode == "grpc" else inproc
        d = res[mode]
        for i, p in enumerate(prompts):
            t0 = time.perf_counter(); last = t0; toks = []
            for step in eng.generate_stream([p], sp, speculative=(mode != "ar")):
                now = time.perf_counter()
                if any(step.accepted_lengths):
                    d["draft"].append(step.draft_ms); d["search"].append(step.tree_search_ms)
                    d["verify"].append(step.verify_ms); d["step"].append(step.step_ms)
                    d["wall"].append(1e3 * (now - last)); d["fwd"] += 1
                toks.extend(step.new_tokens[0])
                last = now
            d["t"] += time.perf_counter() - t0; d["tok"] += len(toks)
            outs.setdefault(i, {})[mode] = toks
srv.terminate()
med = statistics.median
for mode, d in res.items():
    print(f"{mode:7s} tok/s {d['tok']/d['t']:6.1f}  tau {d['tok']/max(1,d['fwd']):.2f}  median ms: draft {med(d['draft']):.2f} "
          f"search {med(d['search']):.2f} verify {med(d['verify']):.2f} step {med(d['step']):.2f} wall {med(d['wall']):.2f}"
          f"  mean verify {statistics.mean(d['verify']):.2f} mean wall {statistics.mean(d['wall']):.2f}")
print("lossless:", all(len({tuple(v) for v in o.values()}) == 1 for o in outs.values()))
