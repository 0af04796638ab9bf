"""The serving layer: continuous batching around the engine.

The batcher (:mod:`.batcher`), request and chunk types (:mod:`.request`) and incremental
detokenization (:mod:`.detokenizer`).  Imports the step layer and below; the Ray Serve app
(``deployments``) and the public API (:mod:`dart_core.api`) sit on top.
"""
