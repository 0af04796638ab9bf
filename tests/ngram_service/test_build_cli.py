"""The builder as users run it: CLI on files with the default tokenizer,
named corpora, and the corpus readers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dart_core.model.tokenizer import tokenizer_identity
from ngram_service import corpus
from ngram_service.build import build_trie_from_texts, main
from ngram_service.trie import NgramTrie


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ngram_service.build", *args], capture_output=True, text=True,
                          timeout=300)


def test_help():
    r = _run("--help")
    assert r.returncode == 0
    for flag in ("--corpus", "--order", "--min-count", "--memory-mb", "--tokenizer", "--verify"):
        assert flag in r.stdout


def test_cli_builds_from_files(tmp_path, default_tokenizer):
    (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": f"def f{i}(x):\n    return x + {i}\n"})
                                                for i in range(30)))
    sub = tmp_path / "more"
    sub.mkdir()
    (sub / "c.md").write_text("# Title\n\nSome *markdown* text about the quick brown fox.\n")
    out = tmp_path / "out" / "files.trie"
    r = _run(str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), str(sub), "--text-field", "body",
             "-o", str(out), "--order", "4", "--verify", "-q")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["num_documents"] == 32 and summary["order"] == 4
    trie = NgramTrie(out, verify=True)
    name, vocab_hash = tokenizer_identity(default_tokenizer)
    assert trie.info.tokenizer_name == name == "SmolLM2-135M-Instruct"
    trie.check_tokenizer(vocab_hash)
    assert trie.info.metadata["corpus"] == "files"
    fox = default_tokenizer(" quick brown fox jumps", add_special_tokens=False)["input_ids"]
    assert trie.count(fox[:3]) >= 20
    p = trie.probability(fox[:2], [fox[2]])
    assert 0.5 < p[0] <= 1.0


@pytest.mark.parametrize("args,message", [
    (["/nonexistent/corpus.txt"], "corpus file not found"),
    (["--tokenizer", "/nonexistent/model"], "neither"),
])
def test_cli_errors(tmp_path, args, message):
    r = _run(*args, "-o", str(tmp_path / "x.trie"), "-q")
    assert r.returncode == 2
    assert message in r.stderr


def test_cli_bad_jsonl_field(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    assert main([str(tmp_path / "b.jsonl"), "-o", str(tmp_path / "x.trie"), "-q"]) == 2
    assert not (tmp_path / "x.trie").exists()


def test_default_corpus_prefix(tmp_path, default_tokenizer):
    """The real default corpus (ShareGPT package + CPython stdlib), first 300k tokens."""
    summary = build_trie_from_texts(corpus.iter_corpus("default"), tmp_path / "d.trie", default_tokenizer,
                                    corpus_name="default", max_tokens=300_000, progress=False)
    assert 300_000 <= summary.total_tokens < 400_000
    trie = NgramTrie(summary.path, verify=True)
    assert trie.info.metadata["corpus"] == "default"
    assert trie.info.nodes_per_level[0] > 5_000


def test_sharegpt_reader_stops_at_truncation(tmp_path, monkeypatch):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i}"},
                                              {"from": "gpt", "value": f"answer {i}"}]} for i in range(3)]
    text = json.dumps(convs)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index("answer 2") + 3])  # cut inside the third record
    monkeypatch.setattr(corpus, "evaluation_prompts", lambda **_: {"mt-bench": ["Question 1"]})
    assert [len(c) for c in corpus.sharegpt_conversations(path)] == [2, 2]
    # conversation 1 quotes an evaluation prompt (case and spacing aside) and is dropped
    assert list(corpus.sharegpt_assistant_turns(path)) == ["answer 0"]
    assert list(corpus.sharegpt_assistant_turns(path, exclude_evaluation=False)) == ["answer 0", "answer 1"]


def test_training_prompts_can_exclude_alpacaeval(tmp_path, monkeypatch):
    convs = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "a"}]}
             for i in range(3)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    monkeypatch.setenv("DART_SERVE_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError):
        corpus.alpacaeval_instructions(download=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / f"alpacaeval-{corpus.ALPACAEVAL_VERSION}.json").write_text('["Question  1"]')
    assert list(corpus.sharegpt_first_prompts(path)) == ["question 0", "question 1", "question 2"]
    assert list(corpus.sharegpt_first_prompts(path, exclude_alpacaeval=True)) == ["question 0", "question 2"]


def test_both_first_prompt_lists_come_from_one_pass_and_equal_two(tmp_path, monkeypatch):
    """sharegpt_first_prompt_lists = the two sharegpt_first_prompts calls training_prompts made: repeats
    (compared normalised) keep their first text, a repeat whose first conversation quotes AlpacaEval
    is kept from the next one, evaluation quotes are dropped; a changed file is read again."""
    def conv(*human):
        return {"conversations": [t for h in human for t in ({"from": "human", "value": h}, {"from": "gpt", "value": "a"})]}
    convs = [conv("Alpha"), conv("beta", "Quoted instruction"), conv("Gamma"), conv("BETA "), conv("beta"),
             conv("delta", "an MT-Bench turn"), conv("epsilon")]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    monkeypatch.setenv("DART_SERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(corpus, "evaluation_prompts", lambda **_: {"mt-bench": ["An  MT-Bench turn"]})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / f"alpacaeval-{corpus.ALPACAEVAL_VERSION}.json").write_text('["quoted instruction"]')
    every, kept = corpus.sharegpt_first_prompt_lists(path)
    assert list(every) == list(corpus.sharegpt_first_prompts(path)) == ["Alpha", "beta", "Gamma", "epsilon"]
    assert kept == set(corpus.sharegpt_first_prompts(path, exclude_alpacaeval=True)) == {"Alpha", "Gamma", "BETA", "epsilon"}
    assert corpus.sharegpt_first_prompt_lists(path) == (every, kept)
    path.write_text(json.dumps(convs[:2] + [conv("zeta and more")]))
    reads, read = [], corpus.alpacaeval_instructions
    monkeypatch.setattr(corpus, "alpacaeval_instructions", lambda **kw: reads.append(1) or read(**kw))
    assert corpus.sharegpt_first_prompt_lists(path)[0] == ("Alpha", "beta", "zeta and more")
    assert len(reads) == 1  # AlpacaEval is read once a call, a pass or not
    (tmp_path / "data" / f"alpacaeval-{corpus.ALPACAEVAL_VERSION}.json").write_text('["Alpha"]')
    assert corpus.sharegpt_first_prompt_lists(path)[1] == {"beta", "zeta and more"}  # new instructions: read again


def test_real_sharegpt_and_stdlib_readers():
    turns = corpus.sharegpt_assistant_turns()
    first = [next(turns) for _ in range(50)]
    assert all(isinstance(t, str) and t.strip() for t in first)
    src = next(corpus.cpython_stdlib_sources())
    assert "import" in src or "def " in src
    with pytest.raises(ValueError, match="unknown corpus"):
        next(corpus.iter_corpus("nope"))


def test_evaluation_prompts_are_installed():
    prompts = corpus.evaluation_prompts()
    assert len(prompts["mt-bench"]) == 160 and len(prompts["humaneval"]) == 164


def test_reference_tokenisation_adds_special_tokens_and_an_eos_per_document(tmp_path, default_tokenizer):
    """--reference-tokenisation counts exactly the windows of ``tokenizer(text) + [eos]`` per document,
    as the DART reference's builder tokenises; the default counts the plain encoding."""
    from collections import Counter

    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(12)] + ["The quick brown fox."] * 3
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    eos = default_tokenizer.eos_token_id
    for flag, docs in (("--reference-tokenisation",
                        [default_tokenizer(t)["input_ids"] + [eos] for t in texts]),
                       (None, [default_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])):
        out = tmp_path / f"{flag}.trie"
        assert main([str(tmp_path / "docs.jsonl"), "-o", str(out), "--order", "3", "-q"] + ([flag] if flag else [])) == 0
        want = Counter(tuple(d[i:i + m]) for d in docs for i in range(len(d)) for m in range(1, min(3, len(d) - i) + 1))
        trie = NgramTrie(out)
        assert trie.info.total_tokens == sum(len(d) for d in docs)
        assert all(trie.count(list(k)) == c for k, c in want.items())
        assert trie.count([eos]) == (len(texts) if flag else 0)
        assert trie.info.metadata["eos_per_document"] == bool(flag)


def _source_tree(root):
    """A folder as source and documentation packages ship them: text, binaries, gzip'd docs, JSON files."""
    import gzip

    (root / "src").mkdir(parents=True)
    (root / "src" / "main.c").write_text("int main(void) {\n    return add(1, 2);\n}\n" * 5)
    (root / "src" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)) * 4)
    (root / "doc").mkdir()
    (root / "doc" / "guide.txt.gz").write_bytes(gzip.compress(b"Run make, then make install.\n" * 10))
    (root / "doc" / "lib.a.gz").write_bytes(gzip.compress(b"!<arch>\n\0\0binary"))
    (root / "package.json").write_text('{"name": "demo", "version": "1.0.0"}')  # no "text" records
    (root / "broken.json").write_text('{"a": 1}\n{"b": 2}\n')  # not JSON at all
    return root


def test_folders_skip_binaries_read_gzip_and_count_plain_json_as_text(tmp_path):
    root = _source_tree(tmp_path / "tree")
    skipped = []
    docs = list(corpus.iter_files([root], skipped=skipped))
    assert sorted(p.name for p in skipped) == ["lib.a.gz", "logo.png"]
    assert len(docs) == 4
    assert any(d.startswith("Run make, then make install.") for d in docs)  # decompressed
    assert any('"name": "demo"' in d for d in docs) and any('{"b": 2}' in d for d in docs)
    assert all("\0" not in d for d in docs)
    with pytest.raises(ValueError):  # named directly, a .json file must hold records
        list(corpus.iter_files([root / "broken.json"]))
    with pytest.raises(ValueError, match="text"):
        list(corpus.iter_files([root / "package.json"]))


def test_tokeniser_processes_give_the_same_trie(tmp_path, default_tokenizer):
    root = _source_tree(tmp_path / "tree")
    for i in range(40):
        (root / "src" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + sum(range({i}))\n" * (i % 5 + 1))
    summaries = {}
    for workers in (1, 2):
        r = _run(str(root), "-o", str(tmp_path / f"w{workers}.trie"), "--workers", str(workers), "--batch-docs", "4",
                 "-q")
        assert r.returncode == 0, r.stderr
        summaries[workers] = json.loads(r.stdout)
    one, two = (NgramTrie(tmp_path / f"w{w}.trie", verify=True) for w in (1, 2))
    assert summaries[1]["nodes_per_level"] == summaries[2]["nodes_per_level"]
    assert summaries[1]["total_tokens"] == summaries[2]["total_tokens"] and summaries[1]["num_documents"] == 44
    ids = default_tokenizer("def f7(x):\n    return x * 7 + sum(range(7))\nint main(void)", add_special_tokens=False)
    ids = ids["input_ids"]
    for i in range(len(ids) - 2):
        assert one.count(ids[i:i + 3]) == two.count(ids[i:i + 3])
        assert one.count(ids[i:i + 2]) == two.count(ids[i:i + 2])
    assert one.count(ids[:3]) > 0
    assert _run(str(root), "-o", str(tmp_path / "x.trie"), "--workers", "0", "-q").returncode == 2


def test_named_corpus_and_files_together(tmp_path, monkeypatch):
    monkeypatch.setattr("ngram_service.build.iter_corpus", lambda name: iter(["alpha beta gamma"] * 3))
    (tmp_path / "a.txt").write_text("delta epsilon")
    out = tmp_path / "both.trie"
    assert main(["--corpus", "sharegpt", str(tmp_path / "a.txt"), "-o", str(out), "-q"]) == 0
    trie = NgramTrie(out)
    assert trie.info.metadata["corpus"] == "sharegpt+files" and trie.info.metadata["num_documents"] == 4


def test_long_documents_are_tokenised_in_pieces_with_the_same_ids(default_tokenizer, monkeypatch):
    from ngram_service import build_common
    from ngram_service.tokenizer import TrieTokenizer

    code = "".join(f"#define REG_{i:05d}__FIELD_MASK 0x{i * 2654435761 % 2**32:08X}L\n"
                   f"static int f{i}(int x)\n{{\n    return x * {i};  /* é */\n}}\n\n" for i in range(600))
    pieces = build_common.split_long(code, max_chars=4096)
    assert len(pieces) > 10 and "".join(pieces) == code and max(map(len, pieces)) <= 4096
    tok = TrieTokenizer.wrap(default_tokenizer)
    whole = tok.encode_batch([code])[0]
    assert [i for ids in tok.encode_batch(pieces) for i in ids] == whole
    # through the builder's reassembly: documents come out whole, in order, batch limits or not
    monkeypatch.setattr(build_common, "MAX_PIECE_CHARS", 4096)
    monkeypatch.setattr(build_common, "MAX_BATCH_CHARS", 10_000)
    docs = ["short one", code, "x" * 9000, "another"]
    out = list(build_common.tokenized(docs, tok, 3, None, False))
    assert [list(o) for o in out] == tok.encode_batch(docs)
    assert build_common.split_long("y" * 9000, max_chars=4096) == ["y" * 4096, "y" * 4096, "y" * 808]  # no newline: hard cuts
