"""dart-serve's model side, importable without Ray: target adapter
(:mod:`~dart_core.target`), DART draft head (:mod:`~dart_core.draft_head`),
verification and sampling (:mod:`~dart_core.verify`, :mod:`~dart_core.sampling`),
the batched decoding engine (:mod:`~dart_core.engine`), the adaptive tree
budget (:mod:`~dart_core.budget`), continuous batching with its request and
chunk types (:mod:`~dart_core.batcher`, :mod:`~dart_core.request`,
:mod:`~dart_core.detokenizer`) and the public API (:class:`DartModel`).
It depends on :mod:`ngram_service` (tree search, trie, tokenizer identity),
never the reverse."""

from __future__ import annotations

__all__ = ["DartModel", "DartEngine", "SamplingParams"]


def __getattr__(name: str):  # lazy: `import dart_core.tokenizer` stays light
    if name == "DartModel":
        from dart_core.api import DartModel

        return DartModel
    if name == "DartEngine":
        from dart_core.engine import DartEngine

        return DartEngine
    if name == "SamplingParams":
        from dart_core.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
