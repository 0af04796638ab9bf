"""The tree search against the DART reference's own Searcher: the fixture's five cases
(tests/fixtures/reference-ngram/README.md: inputs prepared as the reference's wrapper prepares
them, on the reference's settings, with the fixture trie) give the reference's trees, compared as
sets of root-to-leaf token paths (node order inside a depth is arbitrary in the reference)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ngram_service.convert import convert_reference_trie
from ngram_service.trie import NgramTrie
from ngram_service.tree_search import SearchParams, search_tree

FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference-ngram"
CASES = json.loads((FIXTURE / "tree_search_cases.json").read_text())


@pytest.fixture(scope="module")
def reference_trie(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.trie"
    convert_reference_trie(FIXTURE / "ref_order3.trie", path, vocab_size=49152, progress=False)
    return NgramTrie(path)


def _paths(tokens, parents) -> tuple[set, set]:
    """(every node's root-to-node token path, the leaves' paths); the root's own token left out."""
    def path(i):
        out = []
        while parents[i] >= 0:
            out.append(int(tokens[i]))
            i = parents[i]
        return tuple(reversed(out))

    nodes = {path(i) for i in range(1, len(tokens))}
    leaves = {p for p in nodes if not any(q[:len(p)] == p and len(q) > len(p) for q in nodes)}
    return nodes, leaves


def test_the_settings_are_the_defaults_we_use():
    s = CASES["settings"]
    p = SearchParams(eos_token_id=s["eos_token_id"], context_weight=0.0)
    assert (p.top_k, p.beam_width, p.ngram_weight, p.budget, p.max_depth) == (
        s["topk"], s["beam_width"], s["ngram_weight"], s["remain_total"], s["draft_length"])
    assert s["level_weight"] == f"(l+1)**-{p.level_weight_exponent}" and s["logit_weight"] == f"{p.logit_weight_base}**l"
    assert s["no_ngram_on_first_token"] == (not p.ngram_at_level0) and s["order"] == 3


@pytest.mark.parametrize("case", CASES["cases"], ids=lambda c: f"seed{c['seed']}")
def test_the_reference_searchers_trees(case, reference_trie):
    params = SearchParams(eos_token_id=CASES["settings"]["eos_token_id"], context_weight=0.0)
    tree = search_tree(np.array(case["topk_ids"]), np.array(case["topk_probs"], dtype=np.float32), case["context"],
                       trie=reference_trie, params=params)
    assert int(tree.tokens[0]) == case["context"][-1]
    nodes, leaves = _paths(tree.tokens, tree.parents)
    ref_nodes, ref_leaves = _paths(case["ref"]["draft_tokens"], case["ref"]["parents"])
    assert ref_nodes == {tuple(p) for p in case["ref"]["paths"]}  # the fixture's own derived paths agree
    assert leaves == ref_leaves and nodes == ref_nodes
