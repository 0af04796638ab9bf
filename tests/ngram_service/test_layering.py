"""``ngram_service`` is the bottom layer: no module of it imports ``dart_core``
(or the Serve deployments), and the n-gram host works with torch and
transformers unimportable — it builds a trie from a ``tokenizer.json``, serves
it over gRPC and answers a tree search, through the same client the engine
uses.  The ``tokenizers``-only tokenizer is the engine's tokenizer: same ids,
same identity."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import ngram_service
from ngram_service.tokenizer import TrieTokenizer, load_trie_tokenizer, tokenizer_identity

PACKAGE = Path(ngram_service.__file__).parent
FORBIDDEN = ("dart_core", "deployments", "torch", "transformers")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_ngram_service_module_imports_the_layers_above():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10
    offenders = {}
    for f in files:
        bad = sorted(m for m in imported_modules(f) if m.split(".")[0] in FORBIDDEN
                     and not (m.split(".")[0] == "transformers" and f.name == "tokenizer.py"))
        if bad:
            offenders[str(f.relative_to(PACKAGE))] = bad
    # the one exception: converting a GGUF model's tokenizer to tokenizer.json once (optional, lazy)
    assert offenders == {}, offenders


def test_the_engines_client_does_not_need_the_servers_packages():
    """The tree-search client (what an engine replica imports) loads without the server module and
    its grpcio-health-checking / grpcio-reflection, which a bare GPU machine lacked."""
    code = "import sys, ngram_service.client; print('ngram_service.server' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # (grpc itself may try-import the health package: not checked)


def test_the_check_sees_a_forbidden_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from dart_core.step.engine import DartEngine\n")
    assert "dart_core.step.engine" in imported_modules(f)


def test_the_tokenizers_only_tokenizer_is_the_engines(default_tokenizer):
    tok = load_trie_tokenizer(None)  # the default model's tokenizer.json (converted once, cached)
    texts = ["Hello world!", "def f(x):\n    return x  # é 漢字 🦜", "<|im_start|>user\nhi<|im_end|>", " spaces  "]
    assert tok.encode_batch(texts) == default_tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert tok.vocab_hash == tokenizer_identity(default_tokenizer)[1]
    assert tok.vocab_size == len(default_tokenizer)
    assert TrieTokenizer.wrap(default_tokenizer).vocab_hash == tok.vocab_hash


_BLOCK = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "dart_core"):
            raise ImportError(name + " is made unimportable by this test")
        return None

sys.meta_path.insert(0, Block())
"""

_HOST = """
import json, sys
import numpy as np
from ngram_service.build import build_trie_from_texts
from ngram_service.client import GrpcTreeSearch, InProcessTreeSearch
from ngram_service.server import NgramServer
from ngram_service.tokenizer import load_trie_tokenizer
from ngram_service.tree_search import SearchParams
from ngram_service.trie import NgramTrie
import deployments.ngram  # the n-gram host's Serve deployment module

tokenizer_dir, trie_path = sys.argv[1], sys.argv[2]
tok = load_trie_tokenizer(tokenizer_dir)
texts = ["def add(a, b):\\n    return a + b\\n", "The quick brown fox jumps over the lazy dog."] * 20
summary = build_trie_from_texts(texts, trie_path, tok, progress=False)
server = NgramServer(trie_path, threads=2).start()
client = GrpcTreeSearch(server.address, vocab_hash=tok.vocab_hash, timeout_ms=5000)
rng = np.random.default_rng(0)
ids = rng.integers(0, tok.vocab_size, size=(2, 4, 5))
ids[:, 0, 0] = tok.encode_batch([" b"])[0][0]
probs = np.full((2, 4, 5), 0.2, np.float32)
contexts = [np.array(tok.encode_batch(["return a +"])[0]), np.array([ids[1, 0, 1]])]
trees = client.search(ids, probs, contexts, SearchParams(top_k=5))
local = InProcessTreeSearch(NgramTrie(trie_path)).search(ids, probs, contexts, SearchParams(top_k=5))
same = all(a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
           for a, b in zip(trees, local))
client.close()
server.stop()
print(json.dumps({"tokens": summary.total_tokens, "nodes": [t.num_nodes for t in trees], "same": same,
                  "fallbacks": client.fallbacks, "loaded": sorted(m for m in ("torch", "transformers", "dart_core")
                                                                    if m in sys.modules)}))
"""


def test_the_ngram_host_runs_without_torch_and_transformers(default_tokenizer, tmp_path):
    from ngram_service.tokenizer import tokenizer_folder

    folder = tokenizer_folder(None)  # what `trie: auto` hands the n-gram replica
    root = Path(__file__).resolve().parents[2]
    blocked = subprocess.run([sys.executable, "-c", _BLOCK + "import torch"], capture_output=True, text=True)
    assert blocked.returncode != 0 and "unimportable" in blocked.stderr  # the block works
    run = subprocess.run([sys.executable, "-c", _BLOCK + _HOST, str(folder), str(tmp_path / "host.trie")],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["tokens"] > 100 and out["same"] and out["fallbacks"] == 0 and out["loaded"] == []
    assert all(n > 1 for n in out["nodes"])
