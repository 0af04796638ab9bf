"""DartModel: one-call loading from local folders and generate() on ids, text
and chat messages, streaming or not."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from dart_core import DartModel
from dart_core.spec.draft_head import DartDraftHead, DraftHeadConfig, save_draft_head
from ngram_service.build import build_trie_from_texts
from ngram_service.trie import TokenizerMismatchError


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_tokenizer):
    """A tiny random Llama saved with the SmolLM2 tokenizer, as a user's local model folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(default_tokenizer), max_position_embeddings=512,
                      eos_token_id=default_tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    return folder


def test_generate_inputs_and_streaming(tiny_folder):
    model = DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, budget=6, device="cpu")
    chat = [{"role": "user", "content": "Hello there"}]
    out = model.generate(chat, max_new_tokens=12, stop_token_ids=[])
    assert len(out) == 1 and len(out[0].token_ids) == 12 and out[0].finish_reason == "length"
    assert out[0].text == model.tokenizer.decode(out[0].token_ids, skip_special_tokens=True)
    ar = model.generate(chat, max_new_tokens=12, stop_token_ids=[], speculative=False)
    assert ar[0].token_ids == out[0].token_ids
    batch = model.generate(["def f(x):", [1, 2, 3], chat], max_new_tokens=5, stop_token_ids=[])
    assert [len(c.token_ids) for c in batch] == [5, 5, 5] and batch[2].token_ids == out[0].token_ids[:5]
    chunks = list(model.generate(chat, max_new_tokens=12, stop_token_ids=[], stream=True))
    assert [t for c in chunks for t in c.token_ids] == out[0].token_ids
    assert "".join(c.text for c in chunks) == out[0].text
    assert chunks[-1].finish_reason == "length"


def test_head_and_trie_from_paths(tiny_folder, tmp_path, default_tokenizer, caplog):
    target_cfg = LlamaConfig.from_pretrained(tiny_folder)
    head = DartDraftHead(DraftHeadConfig.for_target(target_cfg, draft_vocab_size=1000))
    save_draft_head(head, tmp_path / "head")
    build_trie_from_texts(["def f(x):\n    return x\n"] * 5, tmp_path / "t.trie", default_tokenizer, progress=False)
    model = DartModel.from_pretrained(str(tiny_folder), head=tmp_path / "head", trie=tmp_path / "t.trie",
                                      budget="auto", device="cpu")
    assert model.engine.head.config.draft_vocab_size == 1000 and model.engine.budget is not None
    assert len(model.generate("def f(x):", max_new_tokens=8)[0].token_ids) <= 8
    with caplog.at_level(logging.WARNING):
        plain = DartModel.from_pretrained(str(tiny_folder), trie=None, device="cpu")
    assert plain.engine.head is None and "decoding autoregressively" in caplog.text


def test_trie_from_another_tokenizer_is_refused(tiny_folder, tmp_path):
    from ngram_service.build import build_trie

    build_trie([[1, 2, 3]], tmp_path / "other.trie", vocab_size=10, tokenizer_name="other", vocab_hash="f" * 64)
    with pytest.raises(TokenizerMismatchError):
        DartModel.from_pretrained(str(tiny_folder), head="random", trie=tmp_path / "other.trie", device="cpu")


def test_device_map_through_accelerate(tiny_folder):
    model = DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, budget=4, device_map="cpu")
    assert model.engine.target.device.type == "cpu"
    assert len(model.generate([1, 2, 3], max_new_tokens=4, stop_token_ids=[])[0].token_ids) == 4


def test_bfloat16_on_cpu_runs(tiny_folder):
    model = DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, budget=4, dtype=torch.bfloat16,
                                      device="cpu")
    out = model.generate([1, 2, 3], max_new_tokens=6, stop_token_ids=[])
    assert len(out[0].token_ids) == 6 and model.engine.head.fc.weight.dtype == torch.bfloat16


def test_cuda_graphs_need_a_cuda_device(tiny_folder):
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, device="cpu", cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_equals_autoregressive(tiny_folder):
    model = DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, budget=8, dtype=torch.float32,
                                      device="cuda")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    dart = model.generate(prompts, max_new_tokens=24, stop_token_ids=[])
    ar = model.generate(prompts, max_new_tokens=24, stop_token_ids=[], speculative=False)
    assert [c.token_ids for c in dart] == [c.token_ids for c in ar]


def test_the_tree_search_knows_the_eos_token(tiny_folder):
    """Trees stop drafting past the end of the answer: the search gets the tokenizer's EOS id."""
    model = DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, budget=6, device="cpu")
    eos = model.tokenizer.eos_token_id
    assert eos is not None and model.engine.search_params.eos_token_id == eos
    from ngram_service.tree_search import SearchParams

    mine = DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, budget=6, device="cpu",
                                     search_params=SearchParams(eos_token_id=5))
    assert mine.engine.search_params.eos_token_id == 5  # an explicit one is kept


_REFERENCE_NGRAM = __import__("pathlib").Path(__file__).parents[1] / "fixtures" / "reference-ngram"


def _reference_layout_head(folder, target_cfg, seed: int = 0):
    """A tiny random head saved the way the DART reference saves one: its tensor names and a
    config.json with the reference's keys (architecture LlamaForCausalLMDart)."""
    import json

    torch.manual_seed(seed)
    head = DartDraftHead(DraftHeadConfig.for_target(target_cfg, draft_vocab_size=512))
    save_draft_head(head, folder, dtype=torch.float32)
    c = head.config
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMDart"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "max_position_embeddings": target_cfg.max_position_embeddings, "vocab_size": target_cfg.vocab_size,
        "draft_vocab_size": 512, "draft_length": c.draft_length, "torch_dtype": "float32"}))


def test_the_references_call_on_a_qwen3_target_is_lossless(tmp_path, default_tokenizer, monkeypatch):
    """``from_pretrained(base_model_name_or_path=, dart_model_name_or_path=, ngram_model_name_or_path=)``
    with a tiny random Qwen3 target, a reference-layout head and a reference n-gram folder
    (the fixture trie as its full.trie): the folder's trie is converted once into the cache and
    memory-mapped, the head takes the reference's double-norm path, and greedy output equals
    transformers' generate token for token."""
    import shutil

    from transformers import Qwen3Config

    monkeypatch.setenv("DART_SERVE_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "tiny-qwen3"
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=len(default_tokenizer),
                      max_position_embeddings=512, eos_token_id=default_tokenizer.eos_token_id)
    hf = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharper distributions than a fresh init, so greedy text has structure
        hf.get_output_embeddings().weight.mul_(8.0)
    hf.save_pretrained(base)
    default_tokenizer.save_pretrained(base)
    _reference_layout_head(tmp_path / "dart-head", cfg)
    (tmp_path / "ngram").mkdir()
    shutil.copy(_REFERENCE_NGRAM / "ref_order3.trie", tmp_path / "ngram" / "full.trie")

    model = DartModel.from_pretrained(base_model_name_or_path=str(base), dart_model_name_or_path=str(tmp_path / "dart-head"),
                                      ngram_model_name_or_path=str(tmp_path / "ngram"), budget=12, device="cpu")
    assert model.engine.head.config.final_norm_twice  # a reference checkpoint drafts on the reference's path
    trie_path = model.engine.tree_search.trie.path
    assert trie_path.parent == tmp_path / "cache" / "tries" / "converted" and trie_path.stem.startswith("full-")
    code = default_tokenizer("import os\nimport sys\n\n\ndef main(argv):\n    ", add_special_tokens=False)["input_ids"]
    target = AutoModelForCausalLM.from_pretrained(base).eval()
    for prompt in (code, code[:5]):
        out = model.generate(prompt, max_new_tokens=24, stop_token_ids=[])
        ids = torch.tensor([prompt])
        want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out[0].token_ids == want
    # converted once: a second load opens the cached file
    mtime = trie_path.stat().st_mtime_ns
    again = DartModel.from_pretrained(str(base), str(tmp_path / "dart-head"), str(tmp_path / "ngram"), budget=12,
                                      device="cpu")
    assert again.engine.tree_search.trie.path == trie_path and trie_path.stat().st_mtime_ns == mtime


def test_reference_names_are_checked(tmp_path, tiny_folder):
    with pytest.raises(TypeError, match="both model= and base_model_name_or_path="):
        DartModel.from_pretrained(str(tiny_folder), base_model_name_or_path=str(tiny_folder), device="cpu")
    (tmp_path / "ngram").mkdir()
    (tmp_path / "ngram" / "small.trie").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no full.trie .*\(it holds: small.trie\)"):
        DartModel.from_pretrained(str(tiny_folder), head="random", ngram_model_name_or_path=tmp_path / "ngram",
                                  device="cpu")
    from ngram_service.convert import ReferenceTrieError

    with pytest.raises(ReferenceTrieError):  # is_small_ngram picks small.trie, here an empty (corrupt) one
        DartModel.from_pretrained(str(tiny_folder), head="random", ngram_model_name_or_path=tmp_path / "ngram",
                                  is_small_ngram=True, device="cpu")
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        DartModel.from_pretrained(str(tiny_folder), head="random", ngram_model_name_or_path="fvliang/dart-ngram",
                                  device="cpu")


def test_draft_weights_choose_the_heads_linear_layers(tiny_folder):
    """``draft_weights``: "auto" is Q8_0 beside a float32 CPU target where a qmm kernel runs
    vectorised (qmm with AVX-512, qmm-a8 with AVX2; else dense, and dense when a draft dtype is
    given); "dense" keeps nn.Linear; an unknown value is refused. Output is the same either way."""
    from dart_core.model.quant import Int4Linear, q8_0_kernel

    dense = DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, budget=4, device="cpu",
                                      draft_weights="dense")
    assert type(dense.engine.head.fc) is not Int4Linear
    auto = DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, budget=4, device="cpu")
    assert (type(auto.engine.head.lm_head) is Int4Linear) == (q8_0_kernel() is not None)
    if q8_0_kernel():  # the head runs q8_0_kernel() whichever kernel the target runs
        assert auto.engine.head.lm_head.kernel == q8_0_kernel()
    assert auto.generate([1, 2, 3], max_new_tokens=8, stop_token_ids=[])[0].token_ids == \
        dense.generate([1, 2, 3], max_new_tokens=8, stop_token_ids=[])[0].token_ids
    with pytest.raises(ValueError, match="draft_weights"):
        DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, device="cpu", draft_weights="q4")
    # an explicit draft dtype is a choice of dense weights: "auto" keeps them, "q8_0" refuses it
    bf16 = DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, budget=4, device="cpu",
                                     draft_dtype=torch.bfloat16)
    assert bf16.engine.head.fc.weight.dtype == torch.bfloat16
    if q8_0_kernel():
        with pytest.raises(ValueError, match="draft_dtype"):
            DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, device="cpu", draft_weights="q8_0",
                                      draft_dtype=torch.bfloat16)
    if not q8_0_kernel():
        with pytest.raises(ValueError, match="AVX-512"):
            DartModel.from_pretrained(str(tiny_folder), head="random", trie=None, device="cpu", draft_weights="q8_0")
