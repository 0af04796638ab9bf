"""Ray Serve application of dart-serve (``deployments/dart.yaml``): OpenAI-compatible
HTTP and gRPC ingress, DART engine replicas with continuous batching, and the
n-gram tree-search service."""
