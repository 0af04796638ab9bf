"""The target model's Hugging Face tokenizer, loaded from local files only.

Where a model comes from (:func:`resolve_model`), the tokenizer identity
stored in every n-gram trie (:func:`tokenizer_identity`) and the conversion
cache live in the torch-free :mod:`ngram_service.tokenizer`, which the n-gram
host shares; this module adds the transformers side the engine needs (chat
template, decoding).
"""

from __future__ import annotations

import logging

from ngram_service.cache import converted_cache, save_converted
from ngram_service.tokenizer import (DEFAULT_MODEL, ModelSource, gguf_special_tokens, resolve_model, tokenizer_folder,
                                    tokenizer_identity)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL", "ModelSource", "resolve_model", "load_tokenizer", "tokenizer_identity",
           "tokenizer_folder", "converted_cache", "save_converted"]


def load_tokenizer(spec: str | None = None):
    """Loads the (fast) Hugging Face tokenizer of a model spec (see :func:`resolve_model`);
    a GGUF model's is converted once and cached (:func:`tokenizer_folder`), with the BOS and
    EOS the GGUF file names (:func:`gguf_special_tokens`).

    Raises:
        FileNotFoundError: as :func:`resolve_model`.
    """
    from transformers import AutoTokenizer

    source = resolve_model(spec)
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_folder(spec))
    except OSError as e:  # an unwritable cache: read the GGUF file itself (slower, every time)
        logger.warning("%s; loading the tokenizer from %s directly", e, source.folder)
        tok = AutoTokenizer.from_pretrained(source.folder, **source.from_pretrained_kwargs())
        if source.gguf_file:
            gguf_special_tokens(tok, source.folder / source.gguf_file)
    tok.dart_model_name = source.name
    return tok
