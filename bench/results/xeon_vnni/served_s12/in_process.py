import sys, time, os
from dart_core.api import DartModel
from dart_core.bench import bench_kernel_config
from dart_core.bench.datasets import load_prompts
from dart_core.bench.serving import in_process_pass, ServingConfig
spec = sys.argv[1] == "dart"; n = int(sys.argv[2]) if len(sys.argv) > 2 else 16
m = DartModel.from_pretrained(None, kernel_config=bench_kernel_config())
p = load_prompts("mt-bench")
in_process_pass(m, p[:1], ServingConfig(requests_per_client=1, max_tokens=8), True)
print("pid", os.getpid(), "ready", flush=True)
open("/tmp/in_process.ready", "w").write(str(os.getpid()))
print(in_process_pass(m, p, ServingConfig(requests_per_client=n, max_tokens=128), spec), flush=True)
