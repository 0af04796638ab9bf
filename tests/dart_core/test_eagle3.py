"""The EAGLE-3 head and its dynamic draft tree against the reference (tests/fixtures/reference-eagle3:
the EAGLE code vendored by the DART reference, run on a random checkpoint in the published layout):
forward logits and KV cache to 1e-5, trees equal over two consecutive drafts, malformed checkpoints
refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dart_core.spec.budget import AdaptiveBudget, VerifyCostCurve
from dart_core.spec.draft_head import HeadLoadError
from dart_core.spec.eagle3 import (Eagle3Cache, Eagle3Config, Eagle3Drafter, Eagle3Head, draft_tree, draft_trees,
                                   load_eagle3_head)
from dart_core.step.engine import DartEngine
from dart_core.step.sampling import SamplingParams

from .conftest import VOCAB, tiny_target

FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference-eagle3"


@pytest.fixture(scope="module")
def reference():
    head = load_eagle3_head(FIXTURE)
    weight = load_file(str(FIXTURE / "target" / "model-00001-of-00001.safetensors"))["model.embed_tokens.weight"]
    return head, torch.nn.Embedding.from_pretrained(weight), load_file(str(FIXTURE / "inputs.safetensors"))


@torch.no_grad()
def test_forward_matches_the_reference(reference):
    head, embed, inp = reference
    ref = load_file(str(FIXTURE / "ref_forward.safetensors"))
    empty = torch.zeros(1, 2, 0, 16)
    h, k, v = head(inp["step1_hidden_states"], embed(inp["step1_draft_input_ids"]), torch.arange(11)[None],
                   empty, empty, None)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, ref["step1_hidden_out"], **close)
    torch.testing.assert_close(head.logits(h), ref["step1_logits"], **close)
    torch.testing.assert_close(k, ref["step1_past_key"], **close)
    torch.testing.assert_close(v, ref["step1_past_value"], **close)
    past = int(inp["step2_past_length"])
    h2, _, _ = head(inp["step2_hidden_states"], embed(inp["step2_draft_input_ids"]),
                    torch.arange(past, past + 3)[None], k, v, None)
    torch.testing.assert_close(h2, ref["step2_hidden_out"], **close)
    torch.testing.assert_close(head.logits(h2), ref["step2_logits"], **close)


@pytest.mark.parametrize("case", ["default", "small"])
def test_trees_equal_the_reference_over_two_drafts(reference, case):
    """Call 1 drafts after the prompt, call 2 after three accepted positions, keeping the real
    positions' cache of call 1 (as the reference's generation loop does)."""
    head, embed, inp = reference
    ref = load_file(str(FIXTURE / "ref_tree.safetensors"))
    total, depth, top_k = ref[f"{case}.params"].tolist()
    cache = Eagle3Cache()
    for call in (1, 2):
        tree = draft_tree(head, embed, cache, inp[f"step{call}_hidden_states"], inp[f"step{call}_draft_input_ids"],
                          total_tokens=total, depth=depth, top_k=top_k)
        want = {name: ref[f"{case}.call{call}.{name}"]
                for name in ("draft_tokens", "tree_mask", "tree_position_ids", "retrieve_indices")}
        assert torch.equal(tree.tokens[None], want["draft_tokens"])
        assert torch.equal(tree.mask().float()[None, None], want["tree_mask"])
        assert torch.equal(tree.depths, want["tree_position_ids"])
        assert torch.equal(tree.paths(), want["retrieve_indices"])
        assert cache.length == inp[f"step{call}_input_ids"].shape[1] - 1  # only real positions are kept
    with pytest.raises(ValueError, match="next ids"):
        draft_tree(head, embed, cache, inp["step2_hidden_states"], inp["step2_input_ids"])
    with pytest.raises(ValueError, match="total_tokens"):
        draft_tree(head, embed, Eagle3Cache(), inp["step1_hidden_states"], inp["step1_draft_input_ids"],
                   total_tokens=100, depth=1, top_k=4)


def _copy(tmp_path: Path, edit_state=None, edit_config=None, binary: bool = False) -> Path:
    folder = tmp_path / "head"
    folder.mkdir()
    config = json.loads((FIXTURE / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (folder / "config.json").write_text(json.dumps(config))
    state = load_file(str(FIXTURE / "model.safetensors"))
    if edit_state:
        edit_state(state)
    if binary:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, str(folder / "model.safetensors"))
    return folder


def test_a_pytorch_bin_checkpoint_loads_the_same(tmp_path, reference):
    head = load_eagle3_head(_copy(tmp_path, binary=True))
    for (name, a), b in zip(head.state_dict().items(), reference[0].state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("edit_state, edit_config, target_hidden, message", [
    (lambda s: s.pop("d2t"), None, None, "missing d2t"),
    (lambda s: s.update({"fc.weight": torch.zeros(96, 192)}), None, None, r"fc.weight: checkpoint \(96, 192\)"),
    (None, None, 64, "fc reads 288 features"),
    (lambda s: s.update({"lm_head.weight": torch.zeros(100, 96)}), None, None, "lm_head.weight"),
    (lambda s: s.update({"d2t": torch.full((384,), 10_000)}), None, None, "outside the target vocabulary"),
    (None, lambda c: c.update({"architectures": ["LlamaForCausalLM"]}), None, "not an EAGLE-3 head"),
    (None, lambda c: c.pop("hidden_size"), None, "lacks hidden_size"),
])
def test_malformed_checkpoints_are_refused_by_name(tmp_path, edit_state, edit_config, target_hidden, message):
    folder = _copy(tmp_path, edit_state, edit_config)
    target = None
    if target_hidden is not None:
        from transformers import LlamaConfig

        target = LlamaConfig(hidden_size=target_hidden, vocab_size=768)
    with pytest.raises(HeadLoadError, match=message):
        load_eagle3_head(folder, target)


def test_missing_and_corrupt_files_are_refused(tmp_path):
    folder = _copy(tmp_path)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(HeadLoadError, match="unreadable"):
        load_eagle3_head(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(HeadLoadError, match="neither model.safetensors nor pytorch_model.bin"):
        load_eagle3_head(folder)
    shutil.rmtree(folder)
    with pytest.raises(HeadLoadError, match="no config.json"):
        load_eagle3_head(folder)


def _random_head(target, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.config))
    return head.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("lengths", [[7], [3, 11, 1, 6]])
def test_greedy_decoding_with_the_eagle3_drafter_equals_autoregressive(arch, lengths):
    """The engine with an EAGLE-3 drafter (a random head) verifies its trees losslessly, at batch 1
    and 4, with a fixed tree size and with the adaptive budget choosing nodes."""
    target = tiny_target(arch)
    rng = np.random.default_rng(len(lengths))
    prompts = [[int(x) for x in rng.integers(0, VOCAB, size=n)] for n in lengths]
    sp = SamplingParams(max_new_tokens=20)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    for size in ((12, 3, 4), (8, 2, 3)):
        drafter = Eagle3Drafter(_random_head(target), target.embed_tokens, total_tokens=size[0], depth=size[1],
                                top_k=size[2])
        out = DartEngine(target, drafter=drafter).generate(prompts, sp)
        assert out.token_ids == ar.token_ids
        assert out.verified_nodes > 2 * out.sequence_steps  # the steps verified trees, not roots alone
    for sized in (False, True):  # the budget choosing nodes; and sizing each draft too (tree_size)
        budget = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.5)))
        drafter = Eagle3Drafter(_random_head(target, 1), target.embed_tokens, total_tokens=12, depth=3, top_k=4,
                                budget=budget if sized else None)
        assert DartEngine(target, drafter=drafter, budget=budget).generate(prompts, sp).token_ids == ar.token_ids


def test_an_adaptive_budget_sizes_each_eagle3_draft_to_what_it_keeps(reference):
    """Eagle3Drafter.tree_size: without a budget, or before the budget saw a step, the drafter's
    own sizes; after a step that kept two nodes, to depth 2, three levels below the root (two
    expansions) over a frontier of 4 (the budget's node limit) and 5 nodes.  The smaller frontier
    and top-k lose nothing: at those node and level counts the tree equals the one drafted with
    the drafter's wider top-k (a node's score is below its parent's, so the best n nodes' parents
    are among the best n)."""
    from ngram_service.tree_search import DraftTree, TreeBatch

    head, embed, inp = reference
    budget = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.5)))
    drafter = Eagle3Drafter(head, embed, total_tokens=30, depth=4, top_k=6, budget=budget)
    assert drafter.tree_size() == (30, 4, 6) and Eagle3Drafter(head, embed).tree_size() == (60, 7, 10)
    chain = DraftTree.from_parents(np.array([1, 2, 3, 4]), np.array([-1, 0, 1, 2]), np.array([0, 1, 2, 3]),
                                   np.zeros(4), np.array([1.0, 0.9, 0.01, 0.01]))
    budget.select_batch(TreeBatch.from_trees([chain]))  # keeps two nodes, to depth 2
    assert (budget.search_depth(5), budget.node_limit(29)) == (3, 4)
    assert drafter.tree_size() == (5, 2, 4)
    trees = [draft_tree(head, embed, Eagle3Cache(), inp["step1_hidden_states"], inp["step1_draft_input_ids"],
                        total_tokens=5, depth=2, top_k=k) for k in (4, 6)]
    assert len(trees[0].tokens) == 5 and int(trees[0].depths.max()) <= 3
    for name in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(trees[0], name), getattr(trees[1], name))
    torch.testing.assert_close(trees[0].scores, trees[1].scores)


def test_drafter_sizes_are_checked(reference):
    with pytest.raises(ValueError, match="total_tokens"):
        Eagle3Drafter(reference[0], reference[1], total_tokens=30, depth=1, top_k=4)


def test_sampling_with_the_eagle3_drafter_matches_the_target_distribution():
    """The second and third sampled tokens (drafted at depths 1 and 2 of EAGLE trees, accepted or
    resampled) follow their exact marginals under the target (chi-square, fixed seeds)."""
    from .test_engine import _assert_columns_follow, _marginals_of_tokens_2_and_3

    target = tiny_target("llama", seed=11)
    prompt = [5, 17, 42]
    p2, p3 = _marginals_of_tokens_2_and_3(target, prompt, SamplingParams(temperature=0.6))
    drafter = Eagle3Drafter(_random_head(target, 0), target.embed_tokens, total_tokens=24, depth=2, top_k=8)
    res = DartEngine(target, drafter=drafter).generate(
        [prompt] * 3000, SamplingParams(temperature=0.6, max_new_tokens=4, seed=1))
    assert res.tau > 1.1  # drafts were accepted, not only residual draws
    _assert_columns_follow(np.array(res.token_ids), p2, p3)


def test_dart_model_with_method_eagle3(tiny_model_dir):
    """``SpeculativeConfig(method="eagle3")`` loads an EAGLE-3 head (a folder, or "random") and
    drafts with it under the adaptive budget; greedy text equals autoregressive decoding; without
    a head it is refused, since none ships for the tiny model (the default model's: test_shipped_head)."""
    from dart_core.api import DartModel
    from dart_core.spec.speculative import SpeculativeConfig

    cfg = SpeculativeConfig(method="eagle3", eagle3_total_tokens=12, eagle3_depth=3, eagle3_top_k=4)
    model = DartModel.from_pretrained(tiny_model_dir, head="random", trie=None, speculative_config=cfg)
    assert isinstance(model.engine.drafter, Eagle3Drafter) and model.engine.head is None
    assert model.engine.drafter.budget is model.engine.budget is not None  # the budget sizes its drafts
    prompt = [{"role": "user", "content": "Count from one to ten."}]
    ar = model.generate(prompt, max_new_tokens=16, speculative=False)
    assert model.generate(prompt, max_new_tokens=16)[0].token_ids == ar[0].token_ids
    with pytest.raises(ValueError, match="needs an EAGLE-3 head"):
        DartModel.from_pretrained(tiny_model_dir, trie=None, speculative_config=cfg)
    none = DartModel.from_pretrained(tiny_model_dir, trie=None, speculative_config=SpeculativeConfig(method="none"))
    assert none.engine.drafter is None
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="eagle3_total_tokens"):
        SpeculativeConfig(method="eagle3", eagle3_total_tokens=50, eagle3_depth=1, eagle3_top_k=4)


def test_eagle3_training_learns_saves_a_loadable_head_that_decodes_losslessly(tmp_path, monkeypatch):
    """``method="eagle3"``: the training-time test trains an EAGLE-3 head from the DART trainer's
    teacher features; held-in loss falls and top-1 rises at every unrolled step, and the saved head
    (published layout) loads and drafts with greedy output equal to autoregressive decoding."""
    from dart_core.train.eagle3 import evaluate_eagle3_accuracy, init_eagle3_head
    from dart_core.train.features import Features
    from dart_core.train.trainer import TrainConfig, train

    from .test_train import _small_run

    target, base = _small_run(tmp_path, monkeypatch)
    base.update(epochs=12, lr=3e-3, anchors_per_seq=16, batch_size=3, eval_tau_prompts=2, eval_tau_tokens=8)
    summary = train(TrainConfig(out=str(tmp_path / "eagle3"), method="eagle3", ttt_steps=3, **base), target=target,
                    progress=False)
    assert summary["finished"] and len(summary["eval"][-1]["top1"]) == 3 and summary["eval"][-1]["tau"] >= 1.0
    feats = Features(tmp_path / "cache" / "train" / "features")
    rows = list(range(12))
    before = evaluate_eagle3_accuracy(init_eagle3_head(target, np.asarray(feats.draft_vocab), 0),
                                      target.embed_tokens, feats, rows, "cpu", 3, 0.6)
    head = load_eagle3_head(tmp_path / "eagle3", target.config)
    after = evaluate_eagle3_accuracy(head, target.embed_tokens, feats, rows, "cpu", 3, 0.6)
    assert after["loss"] < 0.7 * before["loss"], (before, after)
    assert all(a > b + 0.1 for a, b in zip(after["top1"], before["top1"])), (before, after)
    prompts = [[3, 14, 15, 92], [65, 35]]
    sp = SamplingParams(max_new_tokens=16)
    drafter = Eagle3Drafter(head, target.embed_tokens, total_tokens=12, depth=3, top_k=4)
    assert (DartEngine(target, drafter=drafter).generate(prompts, sp).token_ids
            == DartEngine(target).generate(prompts, sp, speculative=False).token_ids)
    with pytest.raises(ValueError, match="method eagle3 trains from scratch"):
        train(TrainConfig(out=str(tmp_path / "x"), method="eagle3", init_from=str(tmp_path / "eagle3"), **base),
              target=target, progress=False)


@pytest.mark.parametrize("case", ["default", "small"])
def test_a_batched_draft_gives_each_row_the_reference_tree(reference, case):
    """draft_trees over two rows at once, of different cache lengths and new positions (the
    reference's first draft, and its second after the first's cache), gives both reference trees
    and the new positions' keys and values of drafting each row alone."""
    head, embed, inp = reference
    ref = load_file(str(FIXTURE / "ref_tree.safetensors"))
    total, depth, top_k = ref[f"{case}.params"].tolist()
    first = Eagle3Cache()
    draft_tree(head, embed, first, inp["step1_hidden_states"], inp["step1_draft_input_ids"],
               total_tokens=total, depth=depth, top_k=top_k)
    h, kv = head.config.num_key_value_heads, head.config.head_dim
    keys = torch.zeros(2, h, 11, kv)
    values = torch.zeros(2, h, 11, kv)
    keys[1], values[1] = first.keys[0], first.values[0]
    taps = torch.zeros(2, 11, 288)
    taps[0], taps[1, :3] = inp["step1_hidden_states"][0], inp["step2_hidden_states"][0]
    nexts = torch.zeros(2, 11, dtype=torch.long)
    nexts[0], nexts[1, :3] = inp["step1_draft_input_ids"][0], inp["step2_draft_input_ids"][0]
    trees, new_k, _ = draft_trees(head, embed, keys, values, torch.tensor([0, 11]), taps, nexts, torch.tensor([11, 3]),
                                  total_tokens=total, depth=depth, top_k=top_k)
    for tree, call in zip(trees, (1, 2)):
        assert torch.equal(tree.tokens[None], ref[f"{case}.call{call}.draft_tokens"])
        assert torch.equal(tree.paths(), ref[f"{case}.call{call}.retrieve_indices"])
    torch.testing.assert_close(new_k[0], first.keys[0], atol=1e-5, rtol=1e-5)


def test_the_decoding_benchmark_runs_eagle3_losslessly(tiny_model_dir, tmp_path):
    """``python -m dart_core.bench --methods autoregressive eagle3 --eagle3-head DIR``: EAGLE-3 beside
    autoregressive decoding on the same target, lossless, its τ and phases reported; without a
    head it is refused by name."""
    from transformers import AutoConfig

    from dart_core.bench import decoding
    from dart_core.spec.eagle3 import save_eagle3_head

    torch.manual_seed(0)
    save_eagle3_head(Eagle3Head(Eagle3Config.for_target(AutoConfig.from_pretrained(tiny_model_dir))),
                     tmp_path / "eagle3", dtype=None)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Write a function that adds two numbers."}\n{"prompt": "def fib(n):"}\n')
    base = dict(model=tiny_model_dir, head="random", trie="none", datasets=[str(prompts)], num_prompts=2,
                max_new_tokens=10, repeats=1)
    result = decoding.run_decoding(decoding.DecodingConfig(
        **base, methods=["autoregressive", "eagle3"], eagle3_head=str(tmp_path / "eagle3"), eagle3_total_tokens=8),
        progress=False)
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["eagle3"]["lossless"] is True and rows["eagle3"]["tau"] >= 1.0
    assert rows["eagle3"]["ms_per_step"]["draft"] > 0
    with pytest.raises(ValueError, match="needs an EAGLE-3 head folder"):  # none ships for the tiny model
        decoding.run_decoding(decoding.DecodingConfig(**base, methods=["eagle3"]), progress=False)


def test_the_methods_benchmark_compares_dart_and_eagle3_losslessly(tiny_model_dir, tmp_path):
    """``python -m dart_core.bench.methods``: DART and EAGLE-3 (random heads) beside autoregressive
    decoding on one target at two batch sizes, every row lossless, its τ, phases and speed-up, and
    the table's DART ÷ EAGLE-3; without an EAGLE-3 head for a model none ships for, it is refused."""
    from transformers import AutoConfig

    from dart_core.bench import methods
    from dart_core.spec.eagle3 import save_eagle3_head

    torch.manual_seed(0)
    save_eagle3_head(Eagle3Head(Eagle3Config.for_target(AutoConfig.from_pretrained(tiny_model_dir))),
                     tmp_path / "eagle3", dtype=None)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Write a function that adds two numbers."}\n{"prompt": "def fib(n):"}\n'
                       '{"prompt": "Name three colours."}\n')
    cfg = methods.MethodsConfig(eagle3_head=str(tmp_path / "eagle3"), model=tiny_model_dir, head="random",
                                trie="none", datasets=[str(prompts)], num_prompts=3, max_new_tokens=8,
                                batch_sizes=[1, 2], repeats=2)
    result = methods.run_methods(cfg, progress=False)
    rows = {(r["batch"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(b, m) for b in (1, 2) for m in methods.METHODS}
    assert all(r["lossless"] and len(r["tokens_per_s_runs"]) == 2 for r in rows.values())
    assert rows[(1, "autoregressive")]["speedup"] == 1.0
    assert rows[(1, "autoregressive")]["tau"] == rows[(2, "autoregressive")]["tau"] == 1.0  # per sequence
    for b in (1, 2):  # (the random DART head's steps may all be lookup steps, which do not draft)
        assert rows[(b, "eagle3")]["ms_per_step"]["draft"] > 0 and rows[(b, "dart")]["tau"] >= 1.0
        assert set(rows[(b, "dart")]["ms_per_step"]) == {"draft", "tree_search", "verify"}
    md = methods.markdown_table(result)
    assert "| 2 | dart |" in md and "| 2 | eagle3 |" in md and md.count("×") >= 6
    paths = methods.save(result, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["rows"] == result["rows"]
    with pytest.raises(ValueError, match="needs an EAGLE-3 head folder"):  # none ships for the tiny model
        methods.run_methods(methods.MethodsConfig(model=tiny_model_dir, head="random", trie="none"), progress=False)
