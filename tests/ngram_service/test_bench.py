"""The n-gram benchmark's own arithmetic: per-level sizes read from the file's level table."""

from __future__ import annotations

import json

from ngram_service.bench import level_bytes, main
from ngram_service.build import build_trie
from ngram_service.trie import NgramTrie


def test_level_bytes_add_up_to_the_file(tmp_path):
    docs = [[i % 50, (i * 7) % 50, (i * 13) % 50, i % 3] * 20 for i in range(200)]
    s = build_trie(docs, tmp_path / "t.trie", vocab_size=100, order=3)
    levels = level_bytes(str(tmp_path / "t.trie"))
    assert [lv["nodes"] for lv in levels] == s.nodes_per_level
    assert [lv["order"] for lv in levels] == [1, 2, 3]
    # tokens u32 + counts (4 bytes here) + CSR offsets (n + 1 of them, none on the last level)
    assert [lv["count_bytes"] for lv in levels] == [4, 4, 4] and levels[-1]["child_offset_bytes"] == 0
    assert levels[0]["bytes"] == levels[0]["nodes"] * 8 + (levels[0]["nodes"] + 1) * 4
    assert levels[-1]["bytes_per_node"] == 8.0
    arrays = sum(lv["bytes"] for lv in levels)
    assert arrays < s.file_bytes < arrays + 4096 + 64 * 3 * 3  # header, metadata and 64-byte alignment


def test_bench_reports_each_figure(tmp_path, default_tokenizer, capsys):
    from ngram_service.build import build_trie_from_texts
    from ngram_service.corpus import cpython_stdlib_sources

    src = cpython_stdlib_sources()
    path = tmp_path / "py.trie"
    build_trie_from_texts((next(src) for _ in range(30)), path, default_tokenizer, progress=False)
    assert main(["--trie", str(path), "--repeats", "1", "--sequences", "8", "--batch", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trie"]["num_nodes"] == NgramTrie(path).info.num_nodes == sum(lv["nodes"] for lv in out["trie"]["levels"])
    assert out["warm_one_by_one"]["search"]["n"] == 8 and out["warm_one_by_one"]["search"]["p50_ms"] > 0
    assert out["search_us_per_sequence"]["single_thread"] > 0 and "cold_one_by_one" not in out
