"""Paired rounds of thread placements on a running `serve run` whose engine has 1 OpenMP thread
(OMP_NUM_THREADS "1" in a copy of deployments/dart.yaml), plus the same requests through the engine in
this process (2 threads) after each round; MT-Bench, 1 client, 4 requests, 128 tokens.

    python drive.py ROUNDS free,cpu1 OUT.txt          # placements: free, cpu1, split, isolate (place())
    python drive.py ROUNDS free,split,isolate OUT.txt [--no-inproc]

Linux only: sets the CPU affinity of threads (os.sched_setaffinity) of this machine's processes."""
import os, subprocess, sys, time
from dataclasses import replace
from openai import OpenAI
from dart_core.bench.serving import ServingConfig, _level, in_process_pass
from dart_core.bench.datasets import load_prompts

rounds = int(sys.argv[1]); placements = sys.argv[2].split(","); out = sys.argv[3]
inproc = "--no-inproc" not in sys.argv
def engine_pid():
    ps = subprocess.run(["pgrep", "-f", "ServeReplica:dart:DartEngine"], capture_output=True, text=True).stdout.split()
    return ps[0]
def compute_tid(pid):
    best = max(os.listdir(f"/proc/{pid}/task"), key=lambda t: sum(int(x) for x in open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[11:13]))
    return int(best)
def setall(pids, cpus):
    for q in pids:
        try:
            for t in os.listdir(f"/proc/{q}/task"):
                try: os.sched_setaffinity(int(t), cpus)
                except OSError: pass
        except OSError: pass
def place(p, pid):
    allp = [q for q in os.listdir("/proc") if q.isdigit()]
    if p == "free":
        setall(allp, {0, 1}); return
    if p == "cpu1":
        setall(allp, {0, 1}); setall([pid], {1}); return
    tid = compute_tid(pid)
    if p == "split":
        setall(allp, {0, 1}); setall([pid], {0}); os.sched_setaffinity(tid, {1}); return
    if p == "isolate":
        setall(allp, {0}); os.sched_setaffinity(tid, {1}); return
cfg = ServingConfig(concurrency=[1], requests_per_client=4, max_tokens=128)
client = OpenAI(base_url=cfg.url, api_key="unused", max_retries=0, timeout=600)
model = client.models.list().data[0].id
prompts = load_prompts(cfg.dataset)
local = None
if inproc:
    from dart_core.api import DartModel
    from dart_core.bench import bench_kernel_config
    local = DartModel.from_pretrained(None, kernel_config=bench_kernel_config())
    in_process_pass(local, prompts[:1], replace(cfg, requests_per_client=1, max_tokens=8), True)
pid = engine_pid()
with open(out, "a") as f:
    for r in range(rounds):
        order = placements if r % 2 == 0 else placements[::-1]
        modes = ["dart", "no-speculation"] if r % 2 == 0 else ["no-speculation", "dart"]
        for p in order:
            place(p, pid)
            time.sleep(1)
            for m in modes:
                row = _level(client, model, prompts, 1, m, cfg)
                line = f"{r} {p} {m} {row['tokens_per_s']:.1f} ttft {row['ttft_ms']['p50']:.0f} itl {row['itl_ms']['p50']:.1f} tau {row['tau_mean']}"
                print(line, flush=True); f.write(line + "\n"); f.flush()
        place("free", pid)
        if local is not None:
            for m in modes:
                tps = in_process_pass(local, prompts, cfg, m == "dart")
                line = f"{r} in-process {m} {tps:.1f}"
                print(line, flush=True); f.write(line + "\n"); f.flush()
    place("free", pid)
