"""The n-gram deployment serves the DART reference's n-gram folder: converted once on its node."""

from __future__ import annotations

import shutil
from pathlib import Path

FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference-ngram" / "ref_order3.trie"


def test_the_ngram_service_converts_a_reference_folder_once(tmp_path, monkeypatch):
    from deployments.ngram import NgramService

    monkeypatch.setenv("DART_SERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "ngram").mkdir()
    shutil.copy(FIXTURE, tmp_path / "ngram" / "full.trie")
    services = [NgramService.func_or_class({"trie": str(tmp_path / "ngram"), "port": 0, "threads": 1})
                for _ in range(2)]
    try:
        (converted,) = (tmp_path / "cache" / "tries" / "converted").glob("*.trie")
        for svc in services:
            assert svc.server.trie.path == converted and svc.server.trie.info.num_nodes == 90787
            svc.check_health()
    finally:
        for svc in services:
            svc.server.stop(grace_s=0)
