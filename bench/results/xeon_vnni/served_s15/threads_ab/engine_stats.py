"""Prints the running DartEngine replica's stats() as JSON (run beside `serve run deployments/dart.yaml`)."""
import json

import ray
from ray import serve

ray.init(address="auto", namespace="serve", logging_level="ERROR")
print(json.dumps(serve.get_deployment_handle("DartEngine", "dart").stats.remote().result(), default=str, indent=1))
