"""Incremental detokenisation: the streamed text equals the full decode however
the tokens are chunked, a character split over tokens is held back until it is
whole, stop strings end the text across chunks, and the work is linear in the
output length."""

from __future__ import annotations

import numpy as np
import pytest

from dart_core.serve.detokenizer import IncrementalDetokenizer


def stream(tok, ids, chunks, stop=()):
    d = IncrementalDetokenizer(tok, stop)
    out, pos = [], 0
    for n in chunks:
        out.append(d.add(ids[pos:pos + n]))
        pos += n
        if d.stopped:
            return out, d
    out.append(d.finish())
    return out, d


@pytest.mark.parametrize("seed", range(6))
def test_chunked_stream_equals_full_decode(default_tokenizer, seed):
    tok = default_tokenizer
    rng = np.random.default_rng(seed)
    text = "Unicode: é, 漢字, 🦜 and 𝔘!\n    def f(x):  # ünïcödé\n        return x ** 2  🙂🙂"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = ids + [int(t) for t in rng.integers(0, len(tok), size=40)]  # random ids: broken UTF-8 too
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(int(rng.integers(1, 5)))
    out, _ = stream(tok, ids, chunks)
    assert "".join(out) == tok.decode(ids, skip_special_tokens=True)


def test_a_character_split_over_tokens_waits_until_whole(default_tokenizer):
    tok = default_tokenizer
    parrot = tok("🦜", add_special_tokens=False)["input_ids"]
    assert len(parrot) == 3  # byte-level BPE: three partial-UTF-8 tokens
    d = IncrementalDetokenizer(tok)
    assert d.add(tok("Hi", add_special_tokens=False)["input_ids"]) == "Hi"
    assert d.add(parrot[:1]) == "" and d.add(parrot[1:2]) == ""
    assert d.add(parrot[2:]) == "🦜"
    assert d.finish() == ""
    cut = IncrementalDetokenizer(tok)  # a stream ending mid-character flushes what the decoder makes of it
    assert cut.add(parrot[:2]) == "" and cut.finish() == tok.decode(parrot[:2])


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stop_strings_across_chunks(default_tokenizer, chunk):
    tok = default_tokenizer
    text = "First line.\nSecond line.\n\nThird paragraph.\n\nFourth."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out, d = stream(tok, ids, [chunk] * len(ids), stop=["\n\n", "zzz"])
    assert d.stopped and "".join(out) == "First line.\nSecond line."
    # held back while it could still be the start of a stop string, released once it cannot
    held = IncrementalDetokenizer(tok, ["line.\nX"])  # 7 characters: the last 6 are held back
    shown = "".join(held.add([t]) for t in ids)
    assert not held.stopped and shown == text[:-6] and held.finish() == text[-6:]


def test_special_tokens_are_skipped(default_tokenizer):
    tok = default_tokenizer
    ids = tok("Hello", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    out, _ = stream(tok, ids, [1] * len(ids))
    assert "".join(out) == "Hello"


class CountingTokenizer:
    """Bytes as tokens; counts how many tokens all decode calls read."""

    def __init__(self) -> None:
        self.work = 0

    def decode(self, ids, skip_special_tokens=True):
        self.work += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


def test_work_is_linear_in_the_output_length():
    for n in (200, 2000):
        tok = CountingTokenizer()
        ids = list("dart-serve streams text, ünïcödé too. ".encode() * (n // 40 + 1))[:n]
        d = IncrementalDetokenizer(tok, stop=["never"])
        text = "".join(d.add([t]) for t in ids) + d.finish()
        assert text == bytes(ids).decode("utf-8", errors="replace")
        assert tok.work <= 8 * n  # re-decoding the whole output each step would read n²/2 tokens


def test_include_stop_keeps_the_stop_string(default_tokenizer):
    ids = default_tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    d = IncrementalDetokenizer(default_tokenizer, ["gamma"], include_stop=True)
    text = "".join(d.add([t]) for t in ids) + d.finish()
    assert text == "alpha beta gamma" and d.stopped
    d = IncrementalDetokenizer(default_tokenizer, ["gamma"])
    assert "".join(d.add([t]) for t in ids) + d.finish() == "alpha beta "
