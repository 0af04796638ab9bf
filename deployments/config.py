"""User-facing arguments of the Serve application (``args:`` in
``deployments/dart.yaml``), validated with pydantic; every field says what it does."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class NgramConfig(BaseModel):
    """The n-gram tree-search service (a CPU deployment on the n-gram host)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="run the service; false = logits-only tree search in the engine")
    trie: str = Field("auto", description='trie file on the n-gram node; "auto" = the default trie, built from '
                                          "the default corpus on first start and cached")
    port: int = Field(50051, description="gRPC port of the service on its node")
    threads: int | None = Field(None, description="search threads (default: the CPUs of its NUMA node)")
    numa_node: int | None = Field(None, description="NUMA node to bind to (default: the first)")
    timeout_ms: float = Field(50.0, description="engine-side deadline of one tree-search call; slower calls fall "
                                                "back to the logits-only search")
    auth_token_env: str = Field("DART_NGRAM_AUTH_TOKEN", description="environment variable holding an optional "
                                                                     "shared secret between engine and service")


class AppConfig(BaseModel):
    """Everything a user sets for the DART application."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="target model: null = embedded SmolLM2-135M-Instruct, or a local "
                                                "model folder / .gguf file (never a hub)")
    served_model_name: str | None = Field(None, description="name in /v1/models and the `model` field of requests "
                                                            "(default: the model's name)")
    head: str | None = Field(None, description='draft head folder; null = the head shipped for the model; "random" '
                                               "for a random head (tests)")
    dtype: str | None = Field(None, description="float32 / bfloat16 / float16 (default: bfloat16 on CUDA, float32 "
                                                "on CPU)")
    budget: int | str = Field("auto", description='draft nodes per tree: "auto" adapts the tree to the measured '
                                                  "verify cost and speculates only at batch sizes where it measures "
                                                  "faster than autoregressive steps; an int fixes it (always "
                                                  "speculates)")
    top_k: int = Field(25, ge=1, le=256, description="draft tokens per level fed to the tree search")
    beam_width: int = Field(20, ge=1, le=256, description="beam width of the tree search")
    speculative: bool = Field(True, description="false = plain autoregressive serving (the baseline)")
    max_batch_size: int = Field(16, ge=1, description="sequences decoded together by one engine replica")
    max_speculative_batch: int | None = Field(8, ge=1, description="above this many running sequences a step is "
                                                                   "autoregressive (speculation stops paying)")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    max_tokens_limit: int = Field(2048, ge=1, description="largest max_tokens a request may ask for")
    api_key_env: str = Field("DART_API_KEY", description="environment variable with an optional API key; when set, "
                                                         "requests need `Authorization: Bearer <key>`")
    ngram: NgramConfig = Field(default_factory=NgramConfig)
