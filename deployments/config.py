"""User-facing arguments of the Serve application (``args:`` in
``deployments/dart.yaml``), validated with pydantic; every field says what it does.

Tree-search defaults come from :class:`ngram_service.tree_search.SearchParams`
and the bounds from the n-gram server's :class:`ngram_service.server.ServerLimits`,
so a value this config accepts is one the service accepts too.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ngram_service.corpus import NAMED_CORPORA
from ngram_service.live import DEFAULT_MAX_TOKENS
from ngram_service.server import ServerLimits
from ngram_service.tree_search import SearchParams

_LIMITS = ServerLimits()
_DEFAULTS = SearchParams()


class NgramConfig(BaseModel):
    """The n-gram tree-search service (a CPU deployment on the n-gram host)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="run the service; false = logits-only tree search in the engine")
    trie: str = Field("auto", description='n-gram model on the n-gram node: a dart-serve trie file, or the DART '
                                          "reference's .trie file or n-gram folder (its full.trie), converted there "
                                          'once into the cache with `tokenizer`; "auto" = <tokenizer name>-<corpus>-'
                                          "3gram.trie in that node's cache ($DART_SERVE_CACHE/tries), built from "
                                          "`corpus` on first start")
    tokenizer: str | None = Field(None, description="what a missing trie is built with, or a reference n-gram model "
                                                    "converted with: a tokenizer.json (or a folder "
                                                    "holding one) on the n-gram node, which needs only the `tokenizers` "
                                                    "package there, or a model name / path (default: the app's model; "
                                                    "a GGUF model's tokenizer is converted once with transformers)")
    corpus: Literal[NAMED_CORPORA] = Field("default", description="named corpus a missing trie is built from (see "
                                                                  "`python -m ngram_service.build --help`)")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port of the service on its node (0: any free port)")
    host: str | None = Field(None, description="address the service listens on: null = its node's Ray address, "
                                               "the one the engines are told and reach; \"0.0.0.0\" = every "
                                               "interface of the node")
    threads: int | None = Field(None, ge=1, description="search threads (default: the CPUs of its NUMA node)")
    numa_node: int | None = Field(None, ge=0, description="NUMA node to bind to (default: the one with most CPUs)")
    timeout_ms: float = Field(50.0, gt=0, description="engine-side deadline of one tree-search call; slower calls "
                                                      "fall back to the logits-only search")
    local_search: bool = Field(True, description="an engine replica on the service's own node maps the service's "
                                                 "trie file and searches in its own process, with a mirror of the "
                                                 "live corpus pulled every half second (no gRPC round trip per "
                                                 "step); replicas on other nodes, and false, search through the "
                                                 "service")
    learn: bool = Field(True, description="keep a live corpus of the traffic in the service: every engine replica "
                                          "sends each finished request's generated tokens (not a request with "
                                          "\"learn\": false), and every search drafts from what was sent as well "
                                          "(docs/ngram.md, \"Live corpus\"); false: the service learns nothing")
    learn_max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=64, description="the live corpus's cap in tokens; past it the oldest "
                                                              "are evicted")
    learn_prompts: bool = Field(False, description="send each request's prompt tokens too, not only its output")
    learn_snapshot: str | None = Field(None, description="a file on the n-gram node the live corpus is written to "
                                                         "every minute and at shutdown, and reloaded from at start "
                                                         "(a corrupt one is logged and the corpus starts empty); "
                                                         "null: the corpus lives as long as the service")
    auth_token_env: str = Field("DART_NGRAM_AUTH_TOKEN", description="environment variable holding the bearer "
                                                                     "token between engines and service, read where "
                                                                     "the application is built; unset: the "
                                                                     "application generates one at start-up and "
                                                                     "hands it to its replicas (the service always "
                                                                     "requires a token)")


Budget = Union[Literal["auto"], Annotated[int, Field(ge=1, le=_LIMITS.max_budget)]]


class AppConfig(BaseModel):
    """Everything a user sets for the DART application."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="target model: null = embedded SmolLM2-135M-Instruct, or a local "
                                                "model folder / .gguf file (never a hub)")
    served_model_name: str | None = Field(None, description="name in /v1/models and the `model` field of requests "
                                                            "(default: the model's name)")
    head: str | None = Field(None, description='draft head folder; null = the head shipped for the model; "random" '
                                               "for a random head (tests)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="the target's dtype (default: bfloat16 on CUDA, float32 on CPU)")
    weights: Literal["auto", "dense", "gguf-native"] = Field(
        "auto", description='the target\'s weights: "gguf-native" runs a GGUF\'s own 4-bit blocks on the CPU, '
                            '"dense" de-quantises them to dtype; "auto" = gguf-native for a GGUF on the CPU')
    gguf_kernel: Literal["auto", "qmm-a8", "qmm", "aten"] = Field(
        "auto", description='kernel of the GGUF-native layers: "qmm-a8" (8-bit activations, llama.cpp\'s '
                            'arithmetic: the cheapest verification per query token; its text departs from the '
                            'float32 model\'s as llama.cpp\'s does; needs AVX-512 VNNI or AVX2), "qmm" (float32 activations: '
                            'the de-quantised model\'s greedy text), "aten" (PyTorch\'s int4 kernel, bfloat16 '
                            'activations); "auto" = qmm-a8 where the CPU has AVX-512 VNNI or AVX2, else qmm where it '
                            "has AVX-512, else aten. Ignored with dense weights")
    draft_weights: Literal["auto", "dense", "q8_0"] = Field(
        "auto", description='the draft head\'s linear layers: "q8_0" (quantised at load to Q8_0 blocks, run by the '
                            'float32 qmm kernel with AVX-512, by qmm-a8 with AVX2 only), "dense" (dtype of the head: '
                            'bfloat16 beside a float32 target where the CPU has native bf16); "auto" = q8_0 where '
                            'the CPU has AVX-512 or AVX2')
    cuda_graphs: bool = Field(False, description="CUDA only: verify and draft over static KV caches replayed as "
                                                 "CUDA graphs (dart_core.model.cuda_graphs); refused off CUDA")
    budget: Budget = Field("auto", description='draft nodes per tree: "auto" adapts the tree to the measured '
                                               "verify cost and speculates only at batch sizes where it measures "
                                               "faster than autoregressive steps; an int (1.."
                                               f"{_LIMITS.max_budget}) fixes it and always speculates")
    top_k: int = Field(_DEFAULTS.top_k, ge=1, le=_LIMITS.max_k, description="draft tokens per level fed to the "
                                                                            "tree search")
    beam_width: int = Field(_DEFAULTS.beam_width, ge=1, le=_LIMITS.max_beam_width,
                            description="beam width of the tree search")
    context_weight: float = Field(_DEFAULTS.context_weight, ge=0,
                                  description="κ: how far the draft tree trusts a continuation copied from the "
                                              "request's own prompt and output (docs/engine.md, 'Context in the tree'); "
                                              "0 = the paper's search, without the request's context")
    speculative: bool = Field(True, description="false = plain autoregressive serving (the baseline)")
    method: Literal["dart", "eagle3", "none"] = Field(
        "dart", description='the drafter: "dart" (the DART head + the n-gram tree search), "eagle3" (an EAGLE-3 '
                            "head's dynamic tree: `head` names an EAGLE-3 checkpoint folder; null = the one shipped "
                            "for the default model), "
                            '"none" (no drafter: autoregressive decoding)')
    eagle3_head: str | None = Field(None, description="with method dart: an EAGLE-3 checkpoint folder (\"auto\": the "
                                                      "one shipped for the default model) loaded beside "
                                                      "the DART head; each request may then name \"method\": "
                                                      "\"eagle3\" (DART stays the default, both verified in one "
                                                      "forward); null = DART alone")
    eagle3_total_tokens: int | None = Field(None, description="with method eagle3: the most tree nodes, root "
                                                              "included; the adaptive budget drafts fewer where it "
                                                              "keeps fewer (default: the engine's, the reference's 60)")
    eagle3_depth: int | None = Field(None, description="with method eagle3: the most expansions after the first "
                                                       "level (default: the engine's, 7)")
    eagle3_top_k: int | None = Field(None, description="with method eagle3: the most children per node and "
                                                       "frontier width (default: the engine's, 10)")
    max_batch_size: int = Field(16, ge=1, le=_LIMITS.max_batch,
                                description="sequences decoded together by one engine replica")
    max_speculative_batch: int | None = Field(8, ge=1, description="above this many running sequences a step is "
                                                                   "autoregressive (speculation stops paying)")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    max_tokens_limit: int = Field(2048, ge=1, description="largest max_tokens a request may ask for")
    grammar_timeout_s: float = Field(10.0, gt=0, description="structured output: a schema, regex or choice list "
                                                            "that takes longer to compile is refused (400)")
    max_grammar_chars: int = Field(65536, ge=1, description="structured output: longer schemas, regexes or "
                                                           "choice lists are refused (400)")
    recalibrate_after_s: float | None = Field(30.0, ge=0, description="with budget auto: the engine measures its "
                                              "verification cost curve again once, on its first idle second at "
                                              "least this many seconds after start, and keeps the lower of the two "
                                              "(the start-up measurement runs while the node's other replicas "
                                              "start); null: never")
    stream_interval_ms: float = Field(50.0, ge=0, le=1000,
                                      description="streaming: after a request's first chunk, the engine replica "
                                                  "sends its chunks to the ingress in groups, one group per this "
                                                  "many milliseconds (0: only what is already waiting); each "
                                                  "chunk keeps its own step figures (docs/serving.md, 'Stream "
                                                  "interval')")
    stream_items_per_s: float = Field(80.0, ge=0, description="streaming: the most groups per second the engine "
                                      "replica sends over all its open streams: with more streams than this × "
                                      "stream_interval_ms / 1000, each stream's interval grows to open streams ÷ "
                                      "this (docs/serving.md, 'Stream interval'); 0: no cap")
    api_key_env: str = Field("DART_API_KEY", description="environment variable with an optional API key; when set, "
                                                         "requests need `Authorization: Bearer <key>`")
    admin_key_env: str = Field("DART_ADMIN_KEY", description="environment variable with the admin key the admin "
                                                             "routes require (`Authorization: Bearer <key>`: add a "
                                                             "corpus to the live corpus, swap the trie); unset: the "
                                                             "admin routes are off (403)")
    # the rest of dart_core.spec.speculative.SpeculativeConfig: null keeps its default; validated there (below)
    context_window: int | None = Field(None, description="tokens of a request's prompt and output indexed for its "
                                                         "context chains (default: the engine's)")
    context_order: int | None = Field(None, description="longest context the index matches, in tokens (default: "
                                                        "the engine's)")
    lookup_length: int | None = Field(None, description="longest context chain a lookup step verifies alone, 0 = no "
                                                        "lookup steps (default: the engine's)")
    lookup_preference: float | None = Field(None, description="a lookup step is taken when its expected rate reaches "
                                                              "this many times the tree steps' (default: the engine's)")
    gate_probe_every: int | None = Field(None, description="with budget auto, the speculation gate re-measures the "
                                                           "path it is not on every this many steps, 5..1024 "
                                                           "(default: the engine's)")
    max_prefill_tokens: int | None = Field(None, description="joining prompts are prefilled in groups of at most this "
                                                             "many padded tokens (default: the engine's)")
    draft_graphs: bool | None = Field(None, description="with cuda_graphs: false keeps the draft head eager beside "
                                                        "graph-captured verification (default: the engine's, true)")
    pooled_budget: bool | None = Field(None, description="one verification budget across the batch, padding not "
                                                         "computed, on a packed CPU target (default: the engine's, "
                                                         "false)")
    grammar_drafting: bool | None = Field(None, description="structured output: draft trees cut to what the grammar "
                                                            "allows (default: the engine's, true)")
    fold_width: int | None = Field(None, ge=0, description="held draft-head inputs past this many positions are folded "
                                                           "into the head's KV cache (default: the engine's)")
    prefix_cache_tokens: int = Field(8192, ge=0, description="prompts' KV entries kept by each engine replica, in "
                                                             "positions (least recently used evicted first): a "
                                                             "prompt that starts like an earlier one prefills only "
                                                             "the rest; requests with \"learn\": false are not "
                                                             "stored; 0 = off (docs/serving.md, 'Prefix cache')")
    ngram: NgramConfig = Field(default_factory=NgramConfig)

    @model_validator(mode="after")
    def _speculation_is_valid(self) -> "AppConfig":
        self.speculative_config()  # validated where every speculation setting is: SpeculativeConfig
        if self.eagle3_head is not None and self.method != "dart":
            raise ValueError(f"eagle3_head loads an EAGLE-3 head beside the DART head (method dart), not with "
                             f"method {self.method}: method eagle3 takes its checkpoint as head")
        return self

    def speculative_config(self):
        """The engine's :class:`~dart_core.spec.speculative.SpeculativeConfig` (fields left null keep its
        defaults).

        Raises:
            ValueError: a setting SpeculativeConfig refuses."""
        from dart_core.spec.speculative import SpeculativeConfig

        given = {"budget": self.budget, "search": self.search_params(), "cuda_graphs": self.cuda_graphs}
        # every other SpeculativeConfig field is an app field of the same name (null: keep its default)
        optional = {f.name: getattr(self, f.name) for f in dataclasses.fields(SpeculativeConfig)
                    if f.name not in given and getattr(self, f.name) is not None}
        return SpeculativeConfig(**given, **optional)

    def search_params(self) -> SearchParams:
        """The engine's tree-search parameters (a fixed budget's node count; "auto" starts at the default)."""
        budget = self.budget if isinstance(self.budget, int) else _DEFAULTS.budget
        return SearchParams(top_k=self.top_k, beam_width=self.beam_width, budget=budget,
                            context_weight=self.context_weight)
