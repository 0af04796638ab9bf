"""dart-serve's n-gram engine: a memory-mapped n-gram trie, its corpus
builder and the DART draft-tree search, in C++ behind typed wrappers.

- :mod:`ngram_service.trie` — :class:`NgramTrie` (open, look up, verify).
- :mod:`ngram_service.tree_search` — :func:`search_tree`, :func:`search_trees`,
  :class:`SearchParams`, :class:`DraftTree`.
- :mod:`ngram_service.client` — the tree-search client interface, in-process and gRPC.
- :mod:`ngram_service.tokenizer` — model locator, tokenizer identity, ``tokenizers``-only tokenizer.
- :mod:`ngram_service.build` — ``python -m ngram_service.build``.
- :mod:`ngram_service.server` — ``python -m ngram_service.server``.
- :mod:`ngram_service.bench` — ``python -m ngram_service.bench``.

The bottom layer: it imports nothing from ``dart_core`` or ``deployments``,
and needs neither torch nor transformers (transformers only to convert a
GGUF model's tokenizer to ``tokenizer.json`` once).
"""

from ngram_service.tree_search import DraftTree, SearchParams, search_tree, search_trees
from ngram_service.trie import NgramTrie, TokenizerMismatchError, TrieFormatError

__all__ = ["DraftTree", "NgramTrie", "SearchParams", "TokenizerMismatchError", "TrieFormatError",
           "search_tree", "search_trees"]
