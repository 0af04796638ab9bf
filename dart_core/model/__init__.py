"""The model layer: the target model and what runs it.

The target adapter (:mod:`.target`), its decoder and 4-bit GGUF weights (:mod:`.decoder`,
:mod:`.quant`), the C++ kernels' Python side (:mod:`.kernels`), the attention plug-in
(:mod:`.attention`), KV caches (:mod:`.kv_cache`), static buffers and CUDA graphs
(:mod:`.cuda_graphs`), padding rows (:mod:`.rows`), the allocator and device helpers
(:mod:`.allocator`, :mod:`.device`), kernel settings (:mod:`.kernel_config`) and the tokenizer
(:mod:`.tokenizer`).  Imports only :mod:`ngram_service` and itself.
"""
