"""The service's load benchmark runs end to end (its figures are published; it must not rot)."""

from __future__ import annotations

import json

from ngram_service.build import build_trie
from ngram_service.load_bench import main


def test_load_bench_reports_calls_and_no_failures(tmp_path, capsys):
    docs = [[(i * 7 + j) % 300 for j in range(40)] for i in range(300)]
    build_trie(docs, tmp_path / "t.trie", vocab_size=400, order=3)
    assert main(["--trie", str(tmp_path / "t.trie"), "--clients", "2", "--seconds", "1", "--batch", "1", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch1_roundtrip"]["latency_p50_ms"] > 0
    for b in (1, 4):
        assert out[f"batch{b}"]["service_calls"] > 0 and out[f"batch{b}"]["failed_calls"] == 0
        assert out[f"batch{b}"]["service_answers_after_run"]
