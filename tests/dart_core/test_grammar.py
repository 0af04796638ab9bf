"""Structured output: constrained DART output equals constrained autoregressive output at
temperature 0 and follows its distribution above it, every output parses and validates,
grammar-aware drafting (forbidden nodes dropped, forced tokens chained) raises τ without
changing output, unconstrained rows of the same batch are untouched, and bad grammars are
refused with a clear error (compile failures, size and time limits)."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import numpy as np
import pytest
import torch
from scipy import stats

from dart_core.api import DartModel
from dart_core.serve.batcher import BatcherConfig, ContinuousBatcher
from dart_core.spec.budget import AdaptiveBudget, VerifyCostCurve
from dart_core.step.grammar import GrammarCompiler, GrammarError, GrammarSpec
from dart_core.serve.request import GenerationRequest, InvalidRequest
from dart_core.step.sampling import SamplingParams, target_probs
from dart_core.step.verify import accept_constrained
from ngram_service.tree_search import DraftTree

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n", "tags"],
          "properties": {"name": {"enum": ["alpha", "beta", "gamma delta"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return DartModel.from_pretrained(tiny_model_dir, head="random", trie=None, budget=6)


@pytest.fixture(scope="module")
def compiler(model):
    return GrammarCompiler(model.tokenizer, model.engine.target.config.vocab_size)


def _params(model, grammar=None, **kw) -> SamplingParams:
    return model.sampling_params(max_new_tokens=kw.pop("max_new_tokens", 96), grammar=grammar, **kw)


def _text(model, ids) -> str:
    return model.tokenizer.decode([t for t in ids if t != model.tokenizer.eos_token_id])


def _streamed(steps, n: int) -> list[list[int]]:
    """Each of ``n`` sequences' tokens, gathered from ``generate_stream``'s steps."""
    out: list[list[int]] = [[] for _ in range(n)]
    for step in steps:
        for sid, toks in zip(step.seq_ids, step.new_tokens):
            out[sid] += toks
    return out


def test_constrained_dart_equals_constrained_autoregressive_and_validates(model, compiler):
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    prompts = [model.encode(p) for p in ("Give me JSON:", "name ok n tags", "{")]
    sp = _params(model, grammar)
    ar = model.engine.generate(prompts, sp, speculative=False)
    dart = model.engine.generate(prompts, sp)
    assert dart.token_ids == ar.token_ids
    for ids, reason in zip(dart.token_ids, dart.finish_reasons):
        assert reason == "stop"  # the grammar's end (or its EOS) ends the sequence
        jsonschema.validate(json.loads(_text(model, ids)), SCHEMA)
    # a random head drafts nothing useful: the forced keys and punctuation are what gets accepted
    assert dart.tau > 2.0, dart.tau


def test_grammar_aware_drafting_raises_tau_and_keeps_output(model, compiler, monkeypatch):
    g = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    prompts = [model.encode("Give me JSON:")]
    with_drafting = model.engine.generate(prompts, _params(model, g))
    monkeypatch.setattr(model.engine, "grammar_drafting", False)  # the trees as drafted; verification masks
    without = model.engine.generate(prompts, _params(model, g))
    assert with_drafting.token_ids == without.token_ids
    assert with_drafting.tau > without.tau + 1.0, (with_drafting.tau, without.tau)


def test_forced_tokens_are_priced_by_the_adaptive_budget(model, compiler, monkeypatch):
    """Grammar-aware drafting runs before the adaptive budget chooses: under a cost curve where a
    second draft node never pays, a tree step verifies one draft node per sequence at most, forced
    keys included (they used to be added after the choice, unpriced), and the output is unchanged;
    under a flat curve the forced chains are kept and τ is higher."""
    g = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    prompts = [model.encode(p) for p in ("Give me JSON:", "{")]
    sp = _params(model, g)
    want = model.engine.generate(prompts, sp, speculative=False).token_ids

    def run(curve):
        monkeypatch.setattr(model.engine, "budget", AdaptiveBudget(curve))
        steps = list(model.engine.generate_stream(prompts, [sp] * len(prompts)))
        out = _streamed(steps, len(prompts))
        assert out == want
        trees = [s for s in steps if s.speculated and not s.lookup]
        return trees, sum(map(len, out)) / max(sum(len(s.seq_ids) for s in steps[1:]), 1)

    steep, steep_tau = run(VerifyCostCurve((1, 2, 3), (10.0, 1000.0, 2000.0)))
    assert steep and max(max(s.draft_nodes) for s in steep) == 1
    flat, flat_tau = run(VerifyCostCurve((1, 64), (10.0, 10.0)))
    assert max(max(s.draft_nodes) for s in flat) > 1 and flat_tau > steep_tau


def test_unconstrained_rows_of_the_same_batch_are_unchanged(model, compiler):
    g = compiler.compile(GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,4}"))
    free = [model.encode("Once upon a time"), model.encode("def f(x):")]
    alone = model.engine.generate(free, _params(model, max_new_tokens=24)).token_ids
    mixed_prompts = [free[0], model.encode("code:"), free[1]]
    sps = [_params(model, max_new_tokens=24), _params(model, g), _params(model, max_new_tokens=24)]
    out = _streamed(model.engine.generate_stream(mixed_prompts, sps), len(mixed_prompts))
    assert [out[0], out[2]] == alone
    import re
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", _text(model, out[1]))


class _FixedMask:
    """A grammar state that allows a fixed set of tokens everywhere (never stops)."""

    def __init__(self, allowed: list[int], vocab: int) -> None:
        self.ok = torch.zeros(vocab, dtype=torch.bool)
        self.ok[allowed] = True
        self.stopped = False
        self.consumed: list[int] = []

    def mask_logits(self, logits):
        return logits.masked_fill(~self.ok, float("-inf"))

    def consume(self, token):
        assert self.ok[token]
        self.consumed.append(int(token))


def test_constrained_sampling_keeps_the_masked_distribution():
    """Multi-candidate rejection sampling at a node whose children are partly forbidden: the emitted
    token follows the target's distribution masked and renormalised (chi-square, fixed seed)."""
    vocab, allowed = 12, [1, 3, 4, 7, 9]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen) * 1.5
    # root with children 3 (allowed), 5 (forbidden), 9 (allowed); node 1 has child 4
    tree = DraftTree.from_parents([0, 3, 5, 9], [-1, 0, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1])
    sp = SamplingParams(temperature=0.8)
    expected = target_probs(logits[0].masked_fill(~_FixedMask(allowed, vocab).ok, float("-inf")), sp).double()
    counts = np.zeros(vocab)
    n = 6000
    for _ in range(n):
        g = _FixedMask(allowed, vocab)
        acc = accept_constrained(tree.tokens, tree.parents, torch.cat([logits, logits[:1]]), sp, gen, g)
        first = int(tree.tokens[acc.path[1]]) if len(acc.path) > 1 else acc.bonus
        counts[first] += 1
        assert g.consumed[0] == first and len(g.consumed) == len(acc.path)  # path tokens + bonus consumed
    assert counts[[i for i in range(vocab) if i not in allowed]].sum() == 0
    exp = expected.numpy()[allowed]
    exp = exp / exp.sum() * n
    assert stats.chisquare(counts[allowed], exp).pvalue > 1e-3


def test_constrained_sampling_in_the_engine_matches_plain_decoding(model, compiler):
    """At T = 0.8 under a small regex, DART's outputs and autoregressive outputs are drawn from the
    same distribution (chi-square on the output strings, 300 seeded rows each) and all match."""
    import re

    g = compiler.compile(GrammarSpec("regex", "[abc][xyz]"))
    prompt = model.encode("letters:")
    n = 300
    texts = {}
    for speculative in (True, False):
        res = model.engine.generate([prompt] * n, _params(model, g, temperature=0.8, seed=5, max_new_tokens=8),
                                    speculative=speculative)
        texts[speculative] = [_text(model, ids) for ids in res.token_ids]
        assert all(re.fullmatch("[abc][xyz]", t) for t in texts[speculative])
    cells = sorted(set(texts[True]) | set(texts[False]))
    table = np.array([[texts[s].count(c) for c in cells] for s in (True, False)])
    table = table[:, table.sum(0) >= 5]
    assert stats.chi2_contingency(table).pvalue > 1e-3


def test_min_tokens_holds_stop_tokens_back_losslessly(model):
    """vLLM's min_tokens: the token that ended the output is masked until min_tokens tokens are out;
    DART's greedy output equals autoregressive decoding's under the same mask, and sampling at 0.8
    keeps the mask too."""
    prompts = [model.encode("Once upon a time"), model.encode("def f(x):")]
    free = model.engine.generate(prompts, _params(model, max_new_tokens=16), speculative=False).token_ids
    at = next(i for i in range(12) if free[0][i] not in free[0][:i])
    stop = free[0][at]  # a token the first sequence emits early (a tiny random model repeats its first one)
    for temperature in (0.0, 0.8):
        sp = _params(model, max_new_tokens=16, stop_token_ids=(stop,), temperature=temperature, seed=3)
        ar = model.engine.generate(prompts, replace(sp, min_tokens=10), speculative=False)
        dart = model.engine.generate(prompts, replace(sp, min_tokens=10))
        if temperature == 0:
            assert dart.token_ids == ar.token_ids
        for out in ar.token_ids + dart.token_ids:
            assert stop not in out[:9] and len(out) >= 10
    plain = model.engine.generate(prompts, _params(model, max_new_tokens=16, stop_token_ids=(stop,)))
    assert plain.token_ids[0][-1] == stop and len(plain.token_ids[0]) == at + 1  # without it, the stop ends it


def test_the_first_token_is_constrained_too(model, compiler):
    g = compiler.compile(GrammarSpec.choice(["yes", "no"]))
    res = model.engine.generate([model.encode("Answer:")], _params(model, g))
    assert _text(model, res.token_ids[0]) in ("yes", "no") and res.finish_reasons == ["stop"]


@pytest.mark.parametrize("spec, needle", [
    (GrammarSpec.json_schema({"type": "strang"}), "does not compile"),
    (GrammarSpec("regex", "(unclosed"), "does not compile"),
    (GrammarSpec.json_schema({"enum": ["x" * 300] * 300}), "characters"),
    (GrammarSpec.json_schema({"$ref": "#"}, strict=False), "admits no output"),  # only itself: no value
    (GrammarSpec("regex", "[^\\s\\S]"), "admits no output"),
])
def test_bad_grammars_are_refused_by_name(compiler, spec, needle):
    small = GrammarCompiler.__new__(GrammarCompiler)
    small.__dict__.update(compiler.__dict__, max_spec_chars=65536 // 2)
    with pytest.raises(GrammarError, match=needle):
        small.compile(spec)


def test_specs_are_checked_when_made():
    for make in (lambda: GrammarSpec("grammar", "x"), lambda: GrammarSpec.json_schema([1]),
                 lambda: GrammarSpec.choice([]), lambda: GrammarSpec.choice(["a", ""])):
        with pytest.raises(GrammarError):
            make()


def test_the_batcher_refuses_a_slow_compile_and_keeps_serving(model, monkeypatch):
    """A compile over the time limit is a 400-class error, and unconstrained requests run as before;
    a compile within the limit is cached and serves the next identical request.  (The slow compile
    is made slow: a real one under a tiny limit can finish before the limit is checked.)"""
    import time

    build = GrammarCompiler._build

    def slow_build(self, spec):
        time.sleep(0.5)
        return build(self, spec)

    ok = GenerationRequest(prompt="hello", max_tokens=4)
    monkeypatch.setattr(GrammarCompiler, "_build", slow_build)
    with ContinuousBatcher(model.engine, model.tokenizer, BatcherConfig(grammar_timeout_s=0.05)) as b:
        with pytest.raises(InvalidRequest, match="did not compile within"):
            list(b.generate(GenerationRequest(prompt="x", max_tokens=4, grammar=GrammarSpec.json_schema(SCHEMA))))
        assert len([c for c in b.generate(ok)]) >= 1
    monkeypatch.setattr(GrammarCompiler, "_build", build)
    with ContinuousBatcher(model.engine, model.tokenizer) as b:
        spec = GrammarSpec.json_schema(SCHEMA)
        text = "".join(c.text for c in b.generate(GenerationRequest(prompt="x", max_tokens=96, grammar=spec)))
        jsonschema.validate(json.loads(text), SCHEMA)
        assert b.grammar(GenerationRequest(prompt="x", grammar=spec)) is b.grammar(
            GenerationRequest(prompt="y", grammar=spec))


def _reshaped(tokenizer, change):
    """``tokenizer`` rebuilt from its tokenizer.json after ``change(spec)``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    change(spec)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   eos_token=tokenizer.eos_token)


def _byte_fallback_decoder(spec):
    """How transformers 5.17 saves SmolLM2's GGUF tokenizer: a byte-level BPE whose decoder starts
    with ByteFallback (decoding is unchanged: the sequence ends with ByteLevel)."""
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    spec["model"]["byte_fallback"] = True


def test_a_byte_level_tokenizer_saved_with_a_byte_fallback_decoder_is_read_as_byte_level(model, compiler):
    """Found on a GPU machine with transformers 5.17: llguidance read ``Ġ"`` literally and the
    grammar refused the target's own tokens. Constrained decoding through such a tokenizer now
    equals decoding through the original one."""
    import llguidance.hf

    odd = _reshaped(model.tokenizer, _byte_fallback_decoder)
    ids = model.tokenizer.encode(' "x"', add_special_tokens=False)
    assert odd.decode(ids) == ' "x"'
    V = model.engine.target.config.vocab_size
    assert llguidance.hf.from_tokenizer(odd, n_vocab=V).decode_bytes(ids) != b' "x"'  # what went wrong
    spec = GrammarSpec.json_schema(SCHEMA)
    prompts = [model.encode(p) for p in ("Give me JSON:", "{")]
    want = model.engine.generate(prompts, _params(model, compiler.compile(spec)))
    got = model.engine.generate(prompts, _params(model, GrammarCompiler(odd, V).compile(spec)))
    assert got.token_ids == want.token_ids
    for ids in got.token_ids:
        jsonschema.validate(json.loads(_text(model, ids)), SCHEMA)


def test_a_tokenizer_llguidance_cannot_read_is_refused_by_name(model):
    """A tokenizer whose token spellings llguidance would misread (here the byte alphabet without a
    ByteLevel pre-tokenizer to say so) is refused when the compiler is made, and the batcher turns
    that into a 400-class error instead of wrong masks mid-generation."""
    def metaspace(spec):
        _byte_fallback_decoder(spec)
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": True}

    odd = _reshaped(model.tokenizer, metaspace)
    with pytest.raises(GrammarError, match="llguidance reads its tokens"):
        GrammarCompiler(odd, model.engine.target.config.vocab_size)
    with ContinuousBatcher(model.engine, odd) as b:
        with pytest.raises(InvalidRequest, match="unavailable with this tokenizer"):
            list(b.generate(GenerationRequest(prompt="x", max_tokens=4, grammar=GrammarSpec.json_schema(SCHEMA))))
        assert len(list(b.generate(GenerationRequest(prompt="x", max_tokens=4)))) >= 1


def test_a_sentencepiece_style_tokenizer_is_read_with_its_byte_fallback_tokens():
    """The check of grammar_tokenizer does not refuse a SentencePiece-style tokenizer (Metaspace,
    <0xNN> byte tokens in the vocabulary, Llama's decoder, which drops the first leading space):
    a JSON text spelled with byte-fallback tokens is accepted token by token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    text = ['{"name": "alpha", "ok": true, "n": 12, "tags": ["x", "y"]}', "hello world, a test of names"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]))
    spec = json.loads(tok.to_str())  # the byte tokens are plain vocabulary, as in Llama's tokenizer
    spec["added_tokens"] = [a for a in spec["added_tokens"] if not a["content"].startswith("<0x")]
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="</s>",
                                 unk_token="<unk>")
    ids = hf.encode('{"name": "é ok"}', add_special_tokens=False)
    assert any(hf.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # é is spelled in bytes
    state = GrammarCompiler(hf, len(hf)).compile(GrammarSpec.json_schema(
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
         "additionalProperties": False})).start()
    for t in ids:
        state.consume(t)  # raises if the grammar reads any of them as other bytes
