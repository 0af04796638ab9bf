"""dart-serve's model side, importable without Ray, in four layers that import downwards only:

- :mod:`dart_core.model`: the target model, its kernels, attention and KV caches;
- :mod:`dart_core.spec`: the draft head, the drafters, the adaptive budget and gate, the
  speculative configuration;
- :mod:`dart_core.step`: the engine's step (propose → select → verify → accept), sampling,
  grammars, the one-sequence reference step;
- :mod:`dart_core.serve`: continuous batching, request and chunk types, detokenization;

and on top the public API (:class:`DartModel`, :mod:`dart_core.api`), training
(:mod:`dart_core.train`) and the benchmarks (:mod:`dart_core.bench`).  It depends on
:mod:`ngram_service` (tree search, trie, tokenizer identity), never the reverse."""

from __future__ import annotations

__all__ = ["DartModel", "DartEngine", "SamplingParams"]


def __getattr__(name: str):  # lazy: `import dart_core.model.tokenizer` stays light
    if name == "DartModel":
        from dart_core.api import DartModel

        return DartModel
    if name == "DartEngine":
        from dart_core.step.engine import DartEngine

        return DartEngine
    if name == "SamplingParams":
        from dart_core.step.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
