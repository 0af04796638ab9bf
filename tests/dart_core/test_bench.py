"""The benchmark suite on a tiny model: every method runs on the same prompts,
DART (random head, so τ ≈ 1) is lossless against autoregressive decoding,
the table, JSON and chart are written; prompt sets load from files and the
AlpacaEval cache; the results page keeps its hand-written text."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import pytest

from dart_core.bench import datasets, decoding, report
from ngram_service.build import build_trie_from_texts
from ngram_service.corpus import cpython_stdlib_sources


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    rows = [{"prompt": "Write a function that adds two numbers."}, {"turns": ["Explain recursion.", "More?"]},
            {"prompt": "def fib(n):"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_decoding_benchmark_runs_every_method_losslessly(tiny_model_dir, default_tokenizer, prompts_file,
                                                         tmp_path):
    sources = cpython_stdlib_sources()
    trie = tmp_path / "py.trie"
    build_trie_from_texts((next(sources) for _ in range(50)), trie, default_tokenizer, progress=False)
    cfg = decoding.DecodingConfig(model=tiny_model_dir, head="random", trie=str(trie), datasets=[prompts_file],
                                  num_prompts=3, max_new_tokens=12, repeats=2, budget="6",
                                  methods=[*decoding.DEFAULT_METHODS, *decoding.STOCK_METHODS])
    result = decoding.run_decoding(cfg, progress=False)
    rows = {r["method"]: r for r in result["rows"]}
    # the stock-* rows: the tiny Llama target runs LlamaDecoder, and transformers' forward beside it
    assert set(rows) == {*decoding.DEFAULT_METHODS, *decoding.STOCK_METHODS} and not result["skipped"]
    assert all(r["lossless"] is True for r in rows.values())  # HF baselines and all DART variants
    assert all(r["agreement"] == {"prompts_equal": 3, "prompts": 3, "prefix": 1.0} for r in rows.values())
    assert rows["autoregressive"]["speedup"] == 1.0 and rows["autoregressive"]["tau"] == 1.0
    assert all(rows[m]["tau"] >= 1.0 and rows[m]["ms_per_step"]["verify"] > 0 for m in decoding.DART_METHODS)
    assert rows["dart-grpc"]["grpc_fallbacks"] == 0  # the search really went over gRPC
    assert rows["dart"]["ms_per_step"]["tree_search"] > 0 and rows["hf-generate"]["tau"] is None
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in rows.values())
    paths = decoding.save(result, tmp_path / "out")
    table = paths["md"].read_text()
    assert "| dart-grpc |" in table and "**NO**" not in table
    assert json.loads(paths["json"].read_text())["rows"] == result["rows"]
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_comparison_methods_are_skipped_with_a_reason_where_they_do_not_apply(tiny_model_dir, prompts_file):
    cfg = decoding.DecodingConfig(model=tiny_model_dir, head=None, trie="none", datasets=[prompts_file],
                                  num_prompts=1, max_new_tokens=4, repeats=1,
                                  methods=["autoregressive", "dense-autoregressive", "llama-cpp", "llama-cpp-lookup"])
    result = decoding.run_decoding(cfg, progress=False)
    assert [r["method"] for r in result["rows"]] == ["autoregressive"] and result["weights"] == "dense"
    assert result["skipped"]["dense-autoregressive"] == "the run's target is already dense"
    assert "no .gguf file" in result["skipped"]["llama-cpp"] or "pip install" in result["skipped"]["llama-cpp"]
    assert "Skipped llama-cpp-lookup: " in decoding.markdown_table(result)


@pytest.mark.slow
def test_the_4bit_target_is_compared_with_its_float32_weights_and_llama_cpp(prompts_file):
    """SmolLM2's GGUF: the run's target is GGUF-native; the float32 model and llama.cpp (where
    llama-cpp-python is installed; skipped with the install command otherwise) decode the same prompts."""
    import importlib.util

    cfg = decoding.DecodingConfig(head=None, trie="none", datasets=[prompts_file], num_prompts=1, max_new_tokens=6,
                                  repeats=1, methods=["autoregressive", "dense-autoregressive", "llama-cpp"])
    result = decoding.run_decoding(cfg, progress=False)
    rows = {r["method"]: r for r in result["rows"]}
    from dart_core.model.quant import default_kernel

    assert result["weights"] == f"gguf-native (210× Q4_1, 1× Q8_0; {default_kernel()} kernel)"
    assert rows["dense-autoregressive"]["tokens"] > 0 and rows["dense-autoregressive"]["agreement"]["prompts"] == 1
    if importlib.util.find_spec("llama_cpp") is None:
        assert "pip install llama-cpp-python" in result["skipped"]["llama-cpp"]
    else:
        assert rows["llama-cpp"]["tokens"] > 0 and rows["llama-cpp"]["tau"] is None


def test_agreement_counts_equal_outputs_and_the_prefix_before_a_difference():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    assert decoding.agreement(ref, ref) == {"prompts_equal": 3, "prompts": 3, "prefix": 1.0}
    # the second output parts after 2 of its 4 tokens, the third is cut short after 1 of 2
    out = [[1, 2, 3, 4], [5, 6, 0, 8], [9]]
    assert decoding.agreement(out, ref) == {"prompts_equal": 1, "prompts": 3, "prefix": round(7 / 10, 4)}
    with pytest.raises(ValueError, match="2 outputs against 3"):
        decoding.agreement(out[:2], ref)
    row = {"dataset": "d", "method": "dart", "prompts": 3, "tau": 2.0, "tokens_per_s": 10.0, "speedup": 1.5,
           "ms_per_step": None, "lossless": False, "agreement": decoding.agreement(out, ref)}
    table = decoding.markdown_table({"config": {"temperature": 0.0, "max_new_tokens": 4, "budget": "auto",
                                                "repeats": 1}, "device": "cuda", "dtype": "bfloat16", "rows": [row]})
    assert "**NO** (1/3 equal, 70 % before a difference)" in table


def test_decoding_benchmark_refuses_dart_without_a_head(tiny_model_dir, prompts_file):
    cfg = decoding.DecodingConfig(model=tiny_model_dir, head=None, trie="none", datasets=[prompts_file],
                                  methods=["autoregressive", "dart-no-ngram"])
    with pytest.raises(ValueError, match="draft head"):
        decoding.run_decoding(cfg, progress=False)


def test_prompt_sets(prompts_file, tmp_path, monkeypatch):
    assert datasets.load_prompts(prompts_file) == ["Write a function that adds two numbers.", "Explain recursion.",
                                                   "def fib(n):"]
    assert datasets.load_prompts(prompts_file, 1) == ["Write a function that adds two numbers."]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt here"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        datasets.load_prompts(str(bad))
    with pytest.raises(FileNotFoundError, match="neither a dataset"):
        datasets.load_prompts("no-such-set")
    monkeypatch.setenv("DART_SERVE_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError):
        datasets.alpacaeval_instructions(download=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / f"alpacaeval-{datasets.ALPACAEVAL_VERSION}.json").write_text('["a", "b"]')
    assert datasets.load_prompts("alpacaeval") == ["a", "b"]
    assert len(datasets.load_prompts("mt-bench")) == 80 and len(datasets.load_prompts("humaneval")) == 164
    pairs = datasets.load_second_turns("mt-bench-2", 3)
    assert len(pairs) == 3 and pairs[0][0] == datasets.load_prompts("mt-bench")[0] and "previous" in pairs[0][1]
    chat = datasets.second_turn_messages(*pairs[0][:1], "an answer", pairs[0][1])
    assert [m["role"] for m in chat] == ["user", "assistant", "user"] and chat[1]["content"] == "an answer"
    with pytest.raises(ValueError, match="two-turn"):
        datasets.load_prompts("mt-bench-2")
    with pytest.raises(ValueError, match="not a two-turn set"):
        datasets.load_second_turns("mt-bench")


def test_the_context_tuning_split_is_second_turns_outside_the_evaluation_sets():
    from dart_core.bench.tune_context import tuning_conversations
    from ngram_service.corpus import evaluation_prompts, normalise_text

    chats = tuning_conversations(6, pool=200, seed=0)
    assert len(chats) == 6 and all([m["role"] for m in c] == ["user", "assistant", "user"] for c in chats)
    evaluation = {normalise_text(p) for ps in evaluation_prompts().values() for p in ps}
    assert not {normalise_text(m["content"]) for c in chats for m in c} & evaluation
    assert tuning_conversations(6, pool=200, seed=0) == chats != tuning_conversations(6, pool=200, seed=1)


def test_serving_cli_without_a_server_says_so(capsys):
    from dart_core.bench import serving

    assert serving.main(["--url", "http://127.0.0.1:9/v1", "--no-progress", "--concurrency", "1"]) == 2
    assert "no dart-serve app answers at http://127.0.0.1:9/v1" in capsys.readouterr().err


def test_serving_cli_against_a_server_that_is_not_ready_says_so(capsys):
    """Serve's proxy answers 404 until the application is deployed: a one-line error, not a traceback."""
    import http.server
    import threading

    from dart_core.bench import serving

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # 501 for GET
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1"
        assert serving.main(["--url", url, "--no-progress", "--concurrency", "1"]) == 2
        assert f"{url}/models answered HTTP 501" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_serving_cli_says_at_once_when_the_engine_counters_cannot_be_read(capsys, monkeypatch):
    """``--engine-app`` names an application whose engine counters cannot be read (no Ray cluster
    here, a wrong name): a one-line error before any pass, not a sweep without the counters."""
    import http.server
    import threading

    from dart_core.bench import serving, traffic

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                          "owned_by": "dart-serve"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    asked = []
    monkeypatch.setattr(traffic, "engine_stats", lambda app: asked.append(app))  # None: unreadable
    monkeypatch.setattr(serving, "_level", lambda *a: pytest.fail("a pass ran"))
    server = http.server.HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1"
        args = ["--url", url, "--no-progress", "--concurrency", "1", "--engine-app", "nope"]
        assert serving.main(args) == 2 and asked == ["nope"]
        assert "cannot read the step counters of the engine of Serve application 'nope'" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_results_page_keeps_hand_written_text(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(f"# Benchmarks\n\nIntro.\n\n{report.START}\nold\n{report.END}\n\n## Reading the numbers\nKept.\n")
    report._write_page(page, f"{report.START}\nnew\n{report.END}")
    text = page.read_text()
    assert "Intro." in text and "Kept." in text and "new" in text and "old" not in text


def test_the_report_can_publish_an_earlier_decoding_run(tmp_path, capsys):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(f"# Benchmarks\n\n{report.START}\nold\n{report.END}\n")
    args = ["--reuse-decoding", "--no-serving", "--out", str(tmp_path / "out"), "--page", str(page)]
    assert report.main(args) == 2 and "needs" in capsys.readouterr().err  # nothing to reuse yet
    row = {"dataset": "d", "method": "autoregressive", "prompts": 1, "tokens": 4, "tokens_per_s": 2.0,
           "speedup": 1.0, "tau": 1.0, "ms_per_step": None, "lossless": True}
    dec = {"config": {"temperature": 0.0, "max_new_tokens": 4, "budget": "auto", "repeats": 1, "model": None,
                      "head": None},
           "hardware": {"cpu": "cpu", "cpu_count": 2, "python": "3", "torch": "2", "threads": 2},
           "device": "cpu", "dtype": "float32", "trie": None, "prompts": {"d": 1}, "rows": [row], "seconds": 1.0}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "decoding.json").write_text(json.dumps(dec))
    assert report.main(args) == 0
    assert "| d (1) | autoregressive |" in page.read_text() and "old" not in page.read_text()


def _without(monkeypatch, *modules):
    """Makes ``modules`` look uninstalled to the benchmarks' dependency checks and imports."""
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # `import m` raises ImportError


def test_serving_results_are_written_without_matplotlib(tmp_path, monkeypatch):
    from dart_core.bench import serving

    _without(monkeypatch, "matplotlib")
    result = {"config": {"max_tokens": 8, "requests_per_client": 1, "concurrency": [1]},
              "server": {"model": "m", "url": "u"},
              "rows": [{"concurrency": 1, "mode": "dart", "tokens_per_s": 10.0, "requests": 1, "errors": 0,
                        "ttft_ms": {"p50": 1.0, "p99": 1.0}, "itl_ms": {"p50": 1.0, "p99": 1.0}, "tau_mean": 1.5}]}
    paths = serving.save(result, tmp_path)
    assert paths["png"] is None and not (tmp_path / "serving.png").exists()
    assert json.loads(paths["json"].read_text()) == result and "| 1 | dart |" in paths["md"].read_text()


def test_serving_cli_checks_its_dependencies_before_the_sweep(monkeypatch, capsys):
    from dart_core.bench import serving

    _without(monkeypatch, "openai")
    started = []
    monkeypatch.setattr(serving, "run_serving", lambda *a, **kw: started.append(1))
    assert serving.main(["--url", "http://127.0.0.1:9/v1", "--no-progress"]) == 2
    assert started == [] and "needs openai" in capsys.readouterr().err


def test_batching_benchmark_with_the_eagle3_drafter(tiny_model_dir, prompts_file, tmp_path):
    """--method eagle3: the speculative rows are drafted by an EAGLE-3 head, say so, and decode what
    the autoregressive rows decode."""
    from dart_core.bench import batching

    cfg = batching.BatchingConfig(model=tiny_model_dir, head="random", trie="none", concurrency=[2], method="eagle3",
                                  requests_per_client=1, max_tokens=6, dataset=prompts_file, budget="4")
    result = batching.run_batching(cfg, progress=False)
    rows = {r["mode"]: r for r in result["rows"]}
    assert rows["dart"]["errors"] == 0 and rows["dart"]["completion_tokens"] == 12
    assert rows["dart"]["steps"]["speculative_share"] > 0 and result["config"]["method"] == "eagle3"
    assert "eagle3 drafter" in batching.save(result, tmp_path)["md"].read_text()
    with pytest.raises(ValueError, match="method"):
        batching.run_batching(batching.BatchingConfig(method="medusa"), progress=False)


def test_batching_benchmark_runs_without_ray(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    from dart_core.bench import batching, serving

    levels, level = [], batching._level
    monkeypatch.setattr(batching, "_level",
                        lambda b, p, c, spec, cfg: levels.append((c, spec)) or level(b, p, c, spec, cfg))
    cfg = batching.BatchingConfig(model=tiny_model_dir, head="random", trie="none", concurrency=[1, 3],
                                  requests_per_client=2, max_tokens=6, dataset=prompts_file, budget="4")
    result = batching.run_batching(cfg, progress=False)
    # the largest level once per mode, untimed, before the timed levels (whose order alternates)
    assert levels == [(3, True), (3, False), (1, True), (1, False), (3, False), (3, True)]
    rows = {(r["concurrency"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(1, "dart"), (1, "no-speculation"), (3, "dart"), (3, "no-speculation")}
    assert all(r["errors"] == 0 and r["requests"] == 2 * r["concurrency"] for r in rows.values())
    assert all(r["completion_tokens"] == 6 * r["requests"] and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows[(3, "no-speculation")]["tau_mean"] == 1.0 and rows[(3, "dart")]["tau_mean"] >= 1.0
    paths = batching.save(result, tmp_path)
    assert "| 3 | no-speculation |" in paths["md"].read_text() and json.loads(paths["json"].read_text())["rows"]
    assert serving.level_row(1, True, 2.0, serving.new_record())["tokens_per_s"] == 0
    # where the tokens came from: the engine's steps per level
    plain, spec = rows[(3, "no-speculation")]["steps"], rows[(3, "dart")]["steps"]
    assert plain["decode_steps"] > 0 and plain["speculative_share"] == 0 and plain["verified_per_step"] is None
    assert 0 < spec["speculative_share"] <= 1 and spec["verified_per_step"] >= 3 and spec["accepted_per_step"] >= 3
    assert 0 <= spec["padding_share"] < 1 and "| 3 | dart |" in batching.step_table(result)
    assert "padding share" in paths["md"].read_text()


def test_a_sweep_with_repeats_alternates_the_first_mode_and_reports_the_median_pass():
    from dart_core.bench import serving

    class Bar:
        n = 0

        def update(self):
            self.n += 1

    order, rates = [], iter([5.0, 9.0, 1.0, 7.0, 3.0, 2.0, 4.0, 4.0, 6.0, 8.0, 1.0, 2.0])

    def level(c, mode):
        order.append((c, mode))
        return {"concurrency": c, "mode": mode, "tokens_per_s": next(rates)}

    bar = Bar()
    rows = serving.run_sweep([1, 4], ["dart", "no-speculation"], 3, level, bar)
    d, n = "dart", "no-speculation"
    assert order[:6] == [(1, d), (1, n), (1, n), (1, d), (1, d), (1, n)] and order[6:8] == [(4, n), (4, d)]
    assert bar.n == 12  # one update per pass
    by = {(r["concurrency"], r["mode"]): r for r in rows}
    # level 1: dart ran 5, 7, 3 -> median 5; no-speculation ran 9, 1, 2 -> median 2
    assert by[(1, d)]["tokens_per_s"] == 5.0 and by[(1, d)]["tokens_per_s_runs"] == [5.0, 7.0, 3.0]
    assert by[(1, n)]["tokens_per_s"] == 2.0 and by[(1, n)]["tokens_per_s_runs"] == [9.0, 1.0, 2.0]
    assert [(r["concurrency"], r["mode"]) for r in rows] == [(1, d), (1, n), (4, d), (4, n)]
    with pytest.raises(ValueError, match="repeats"):
        serving.run_sweep([1], [d], 0, level, bar)


def test_the_serving_table_pairs_each_repeat_and_counts_the_engine_steps():
    """With repeats, each row's paired ratio is the median of its repeats' ratios to the
    no-speculation pass of the same repeat (not the ratio of the medians); with the engine's step
    counters read after every pass (``engine_steps``), a row sums them over its passes and the table
    says how many speculated; a pass whose counters could not be read leaves the sums out."""
    from dart_core.bench import serving

    class Bar:
        def update(self):
            pass

    # repeat 1: dart 10, no-spec 10; repeat 2 (no-spec first): 20, 16; repeat 3: 9, 12
    rates = iter([10.0, 10.0, 16.0, 20.0, 9.0, 12.0])
    steps = iter([(0, 100), (0, 90), (0, 95), (2, 80), (0, 99), (0, 98)])

    def level(c, mode):
        sp, ar = next(steps)
        return {"concurrency": c, "mode": mode, "tokens_per_s": next(rates), "requests": 2, "errors": 0,
                "ttft_ms": {"p50": 1.0, "p99": 2.0}, "itl_ms": {"p50": 1.0, "p99": 1.0},
                "tau_mean": 1.0, "engine_steps": {"speculative": sp, "autoregressive": ar}}

    rows = serving.run_sweep([8], ["dart", "no-speculation"], 3, level, Bar())
    by = {r["mode"]: r for r in rows}
    assert by["dart"]["tokens_per_s_runs"] == [10.0, 20.0, 9.0]
    assert by["dart"]["engine_steps_all"] == {"speculative": 2, "autoregressive": 279}
    assert by["no-speculation"]["engine_steps_all"] == {"speculative": 0, "autoregressive": 283}
    result = {"config": {"max_tokens": 8, "requests_per_client": 2, "repeats": 3, "learn": False},
              "server": {"model": "m", "url": "u"}, "rows": rows}
    md = serving.markdown_table(result)
    # medians 10 / 12 = 0.83x; paired: median of 10/10, 20/16, 9/12 = 1.00x
    assert "| 8 | dart | 10.0 | 0.83× | 1.00× | 2 | 0 |" in md and md.rstrip().count("\n") > 5
    assert "| 1.00 | 2 of 281 |" in md and "| 1.00 | 0 of 283 |" in md and "speculative steps |" in md
    one_unread = iter([{"speculative": 0, "autoregressive": 9}, None])
    rows = serving.run_sweep([1], ["dart"], 2, lambda c, m: {"concurrency": c, "mode": m, "tokens_per_s": 1.0,
                                                             "engine_steps": next(one_unread)}, Bar())
    assert "engine_steps_all" not in rows[0]


def test_step_tally_counts_verified_accepted_and_padding():
    from dart_core.bench.batching import StepTally
    from dart_core.step.engine import StepOutput

    tally = StepTally()
    step = StepOutput(seq_ids=[0, 1], new_tokens=[[5], [6, 7]], finish_reasons=[None, None], accepted_lengths=[1, 2],
                      draft_nodes=[0, 3], num_nodes=4, draft_ms=0.0, tree_search_ms=0.0, verify_ms=0.0, step_ms=1.0)
    tally.on_step(step, prefill=False)
    tally.on_step(StepOutput(seq_ids=[0, 1], new_tokens=[[5], [6]], finish_reasons=[None, None],
                             accepted_lengths=[1, 1], draft_nodes=[0, 0], num_nodes=1, draft_ms=0.0,
                             tree_search_ms=0.0, verify_ms=0.0, step_ms=1.0), prefill=False)
    tally.on_step(step, prefill=True)  # a prefill is not a decoding step
    # 2 roots + 3 nodes verified out of a layout of 2 x 4; 3 tokens accepted
    assert tally.summary() == {"decode_steps": 2, "speculative_share": 0.5, "verified_per_step": 5.0,
                               "accepted_per_step": 3.0, "padding_share": 0.375}


def test_context_tuning_runs_the_grid_losslessly(tiny_model_dir, tmp_path):
    from dart_core.bench import tune_context

    cfg = tune_context.TuningConfig(weights=[1.0], num_prompts=2, max_new_tokens=8, budget=6, max_prompt_tokens=200,
                                    pool=300, model=tiny_model_dir, head="random", trie="none")
    result = tune_context.run_tuning(cfg, progress=False)
    assert [(r["order"], r["weight"]) for r in result["rows"]] == [(4, 0.0), (4, 1.0)]  # the reference first
    assert all(r["lossless"] and r["tau"] >= 1.0 for r in result["rows"]) and result["prompts"] == 2
    assert result["best"]["weight"] in (0.0, 1.0) and "| 4 |" in tune_context.markdown_table(result)
    assert tune_context.main(["--weights", "1", "--num-prompts", "1", "--max-new-tokens", "4", "--budget", "4",
                              "--max-prompt-tokens", "200", "--model", tiny_model_dir, "--head", "random",
                              "--trie", "none", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "context_tuning.json").read_text())["config"]["budget"] == 4


def test_step_profile_reports_the_floor_and_each_mode(tiny_model_dir, prompts_file, tmp_path):
    """On a CPU: the floor from the target's weights and the measured copy bandwidth, both modes
    timed, no device-kernel figures (there are none to read)."""
    import torch

    from transformers import AutoModelForCausalLM

    from dart_core.bench import step_profile

    cfg = step_profile.StepProfileConfig(model=tiny_model_dir, head="random", trie="none", dataset=prompts_file,
                                         num_prompts=2, max_new_tokens=6, budget="4", copy_mib=8)
    result = step_profile.run_step_profile(cfg, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)  # plain, unpacked
    emb = hf.get_input_embeddings().weight
    tied = hf.get_output_embeddings().weight is emb
    # every weight once; the input embedding only where it is also the output projection
    expected = sum({t.data_ptr(): t.numel() * 4 for t in hf.parameters()}.values()) - (0 if tied else emb.numel() * 4)
    assert result["weights_bytes"] == expected > 0 and result["weights_dtype"] == "float32"
    assert result["bandwidth_gbs"] > 0
    assert result["floor_ms"] == pytest.approx(result["weights_bytes"] / (result["bandwidth_gbs"] * 1e9) * 1e3,
                                               rel=1e-2)
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"autoregressive", "dart"} and rows["autoregressive"]["tau"] == 1.0
    assert all(r["target_forwards"] > 0 and r["step_ms"] > 0 and r["kernel_ms_per_step"] is None
               for r in rows.values())
    assert all("top_ops" not in r for r in rows.values())  # only when asked for
    # the host's share of a step: one read per autoregressive step, and on a CPU none per greedy speculative
    # step (the draft's top-k are host tensors, handed over as views; the trees are walked over host arrays;
    # see test_engine for a GPU's two)
    assert rows["autoregressive"]["host_reads_per_step"] == 1 and rows["dart"]["host_reads_per_step"] == 0
    assert all(r["ops_per_step"] > 0 and r["host_only_ms_per_step"] is not None for r in rows.values())
    paths = step_profile.save(result, tmp_path)
    md = paths["md"].read_text()
    assert "| autoregressive | 1.00 |" in md
    assert "| step ÷ autoregressive | prefill ms/prompt | draft ms | tree ms | verify ms |" in md
    dart, plain = rows["dart"], rows["autoregressive"]
    # three timed repeats, the modes alternating: the ratio is the median of the same repeat's ratios
    assert len(dart["step_ms_per_repeat"]) == len(plain["step_ms_per_repeat"]) == 3
    assert dart["step_ms"] == pytest.approx(statistics.median(dart["step_ms_per_repeat"]), abs=1e-3)
    ratio = statistics.median(a / b for a, b in zip(dart["step_ms_per_repeat"], plain["step_ms_per_repeat"]))
    assert (f"| dart | {dart['tau']:.2f} | {dart['tokens_per_s']:.1f} | {dart['step_ms']:.2f} | {ratio:.3f} | "
            f"{dart['prefill_ms_per_prompt']:.1f} | {dart['phase_ms_per_step']['draft']:.2f} | "
            f"{dart['phase_ms_per_step']['tree_search']:.2f} | ") in md
    assert all(r["prefill_ms_per_prompt"] > 0 and "prefill" not in r["phase_ms_per_step"] for r in rows.values())
    batched = step_profile.run_step_profile(dataclasses.replace(cfg, batch_size=2, modes=["dart", "gated-off",
                                                                                             "autoregressive"]),
                                            progress=False)
    dart, off, plain = batched["rows"]
    assert dart["host_reads_per_step"] == 0  # two prompts decoded together (the operator path): still none
    # the speculative engine with its gate off steps autoregressively, reading the device once per step
    assert off["mode"] == "gated-off" and off["tau"] == 1.0 and off["host_reads_per_step"] == 1
    # and dispatches an autoregressive step's operators plus one view (its root taps, held by reference
    # until speculation resumes): no draft, no tree, no gather, no copy
    assert off["ops_per_step"] == plain["ops_per_step"] + 1
    with pytest.raises(ValueError, match="modes"):
        step_profile.run_step_profile(step_profile.StepProfileConfig(modes=["beam"]), progress=False)
    with pytest.raises(ValueError, match="top_ops"):
        step_profile.run_step_profile(step_profile.StepProfileConfig(top_ops=-1), progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        step_profile.run_step_profile(step_profile.StepProfileConfig(batch_size=0), progress=False)


def test_step_profile_lists_the_operators_taking_the_most_time(tiny_model_dir, prompts_file, tmp_path):
    """--top-ops N: per mode, the N host operators with the most self time per target forward,
    largest first (on a CPU the profiled pass runs for them; no CUDA kernels to list)."""
    from dart_core.bench import step_profile

    cfg = step_profile.StepProfileConfig(model=tiny_model_dir, head="random", trie="none", dataset=prompts_file,
                                         num_prompts=2, max_new_tokens=6, budget="4", copy_mib=8, top_ops=3)
    result = step_profile.run_step_profile(cfg, progress=False)
    for row in result["rows"]:
        host = row["top_ops"]["host"]
        assert len(host) == 3 and row["top_ops"]["device"] == []
        assert [o["self_ms"] for o in host] == sorted((o["self_ms"] for o in host), reverse=True)
        assert host[0]["self_ms"] > 0 and all(o["calls"] > 0 and o["op"] for o in host)
        # per target forward: no operator is called more often than a whole step dispatches operators
        # (counted apart, by the engine's dispatch mode); counts, unlike times, do not depend on how fast
        # the machine runs (a VM's stall inside one operator once read 18 steps' time per forward)
        assert all(o["calls"] <= row["ops_per_step"] for o in host)
    md = step_profile.markdown_table(result)
    assert "dart: operators by self host ms per target forward" in md
    assert f"| `{result['rows'][0]['top_ops']['host'][0]['op'][:80]}` |" in md


def test_step_profile_lists_the_python_functions_taking_the_most_time(tiny_model_dir, prompts_file):
    """--top-python N: per mode, the N Python functions with the most self time per target forward
    under cProfile, largest first; the engine's step is among the profiled calls."""
    from dart_core.bench import step_profile

    cfg = step_profile.StepProfileConfig(model=tiny_model_dir, head="random", trie="none", dataset=prompts_file,
                                         num_prompts=2, max_new_tokens=6, budget="4", copy_mib=8, top_python=4,
                                         modes=["autoregressive", "gated-off"])
    result = step_profile.run_step_profile(cfg, progress=False)
    for row in result["rows"]:
        top = row["top_python"]
        assert len(top) == 4 and [o["self_ms"] for o in top] == sorted((o["self_ms"] for o in top), reverse=True)
        assert top[0]["self_ms"] > 0 and all(o["calls"] > 0 and o["cum_ms"] >= o["self_ms"] for o in top)
    md = step_profile.markdown_table(result)
    assert "gated-off: Python functions by self ms per target forward (under cProfile)" in md
    with pytest.raises(ValueError, match="top_python"):
        step_profile.run_step_profile(step_profile.StepProfileConfig(top_python=-1), progress=False)


def test_the_gpu_section_is_rendered_from_the_results_files(tmp_path):
    """The GPU block holds exactly the tables of the files in the results folder, between its
    markers; hand-written text around it is kept; a folder without a decoding run is refused."""
    from pathlib import Path

    from dart_core.bench import gpu_report, step_profile

    folder = Path(__file__).parents[2] / "bench" / "results" / "gpu-h100"
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(f"# Benchmarks\n\n## GPU\n\nhand-written\n\n{gpu_report.START}\nold\n{gpu_report.END}\n\ntail\n")
    gpu_report.write_gpu_section(folder, page)
    text = page.read_text()
    assert "hand-written" in text and text.rstrip().endswith("tail") and "\nold\n" not in text
    dec = json.loads((folder / "decoding-fp32.json").read_text())
    prof = json.loads((folder / "step_profile-bf16.json").read_text())
    assert decoding.markdown_table(dec) in text and step_profile.markdown_table(prof) in text
    assert prof["hardware"]["gpu"] in text and text.count(gpu_report.START) == 1
    assert "**fp32**:" in text and "CUDA graphs" not in text
    # a run made with --cuda-graphs says so in its heading
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    (graphs / "decoding-fp32-graphs.json").write_text(json.dumps({**dec, "config": {**dec["config"],
                                                                                    "cuda_graphs": True}}))
    assert "**fp32-graphs, CUDA graphs**:" in gpu_report.render_gpu_section(graphs, page)
    with pytest.raises(FileNotFoundError, match="decoding"):
        gpu_report.render_gpu_section(tmp_path, page)
    # batching sweeps say their speculation settings and where the tokens came from
    fifth = gpu_report.render_gpu_section(folder.parent / "gpu-h200-5", page)
    assert "Speculation allowed up to 64 running sequences, the speculation gate off." in fifth
    assert "Speculation allowed up to 8 running sequences, the speculation gate on." in fifth
    assert fifth.count("Speculative steps:") == 3
    # the sixth: a batch of 16 profiled at a fixed budget, and structured output
    sixth = gpu_report.render_gpu_section(folder.parent / "gpu-h100-6", page)
    assert "stepped 16 at a time, 32 new tokens, a fixed budget of 16 draft nodes" in sixth
    from dart_core.bench import structured
    st = json.loads((folder.parent / "gpu-h100-6" / "structured-bf16-graphs.json").read_text())
    assert "### Structured output (bf16-graphs, CUDA graphs" in sixth and structured.markdown_table(st) in sixth


def test_the_gguf_native_section_gives_each_method_against_llama_cpp(tmp_path):
    from dart_core.bench import cpu_report

    def row(method, tps, per_pass, tau=None):
        return {"dataset": "mt-bench", "method": method, "prompts": 8, "tokens": 1024, "tokens_per_s": tps,
                "speedup": per_pass[1], "speedup_per_pass": per_pass, "tau": tau, "ms_per_step": None,
                "lossless": True, "agreement": {"prompts_equal": 8, "prompts": 8, "prefix": 1.0}}

    result = {"config": {"datasets": ["mt-bench"], "num_prompts": 8, "max_new_tokens": 128, "repeats": 3,
                         "budget": "auto", "temperature": 0.0},
              "hardware": {"cpu": "AMD EPYC", "cpu_count": 2, "python": "3.11", "torch": "2.13.0", "threads": 2},
              "device": "cpu", "dtype": "float32", "weights": "gguf-native (210× Q4_1, 1× Q8_0)", "seconds": 60.0,
              "skipped": {}, "rows": [row("autoregressive", 16.0, [1.0, 1.0, 1.0], 1.0),
                                      row("llama-cpp", 50.0, [3.0, 3.2, 3.4]),
                                      row("dart-context", 24.0, [1.5, 1.6, 1.4], 1.9)]}
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "decoding-avx2.json").write_text(json.dumps(result))
    (folder / "commands.md").write_text("python -m dart_core.bench ...")
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("# Benchmarks\n\nhand-written\n")
    cpu_report.write_cpu_section(folder, page)
    text = page.read_text()
    assert "hand-written" in text and "## GGUF-native target (CPU)" in text and text.count(cpu_report.START) == 1
    assert decoding.markdown_table(result) in text and "python -m dart_core.bench ..." in text
    # per pass 1/3, 1/3.2, 1/3.4 and 1.5/3, 1.6/3.2, 1.4/3.4: medians 0.31 and 0.50
    assert "| mt-bench (8) | autoregressive | 16.0 | 0.31× |" in text
    assert "| mt-bench (8) | dart-context | 24.0 | 0.50× |" in text
    cpu_report.write_cpu_section(folder, page)
    assert page.read_text() == text  # re-rendered in place
    with pytest.raises(FileNotFoundError, match="decoding"):
        cpu_report.render_cpu_section(tmp_path, page)


def test_the_gpu_section_gives_the_median_of_repeated_runs_and_the_attention_probe(tmp_path):
    from pathlib import Path

    from dart_core.bench import gpu_report

    dec = json.loads((Path(__file__).parents[2] / "bench" / "results" / "gpu-h100" / "decoding-fp32.json").read_text())
    row = dec["rows"][-1]
    for i, up in enumerate([1.5, 0.9, 2.0], 1):  # median 1.5, not the mean 1.47
        rows = [{**r, "speedup": up if r is row else r["speedup"]} for r in dec["rows"]]
        (tmp_path / f"decoding-bf16-run{i}.json").write_text(json.dumps({**dec, "rows": rows}))
    (tmp_path / "decoding-other.json").write_text(json.dumps(dec))  # a single run: no median row
    probe = {"device": "GPU X", "torch": "2.11", "cudnn": 91900,
             "results": [{"shape": "draft b1", "backend": "default", "new_shape_ms": 54.0, "same_shape_ms": 0.036},
                         {"shape": "draft b1", "backend": "flash", "error": "No available kernel"}]}
    (tmp_path / "sdpa_probe.json").write_text(json.dumps(probe))
    text = gpu_report.render_gpu_section(tmp_path, tmp_path / "BENCHMARKS.md")
    assert f"| bf16 | {row['dataset']} | {row['method']} | 3 |" in text
    assert "| 1.50× | 1.50, 0.90, 2.00 |" in text and "| other |" not in text
    assert "| draft b1 | default | 54.000 | 0.036 |" in text and "refused: No available kernel" in text


def test_the_gpu_section_shows_serve_run_on_the_gpu_machine(tmp_path):
    """serving-<label>.json files (the serving bench against `serve run` there) get their own tables."""
    from pathlib import Path

    from dart_core.bench import gpu_report, serving

    folder = Path(__file__).parents[2] / "bench" / "results" / "gpu-h200-4"
    served = json.loads((folder / "serving-bf16-graphs-budget60.json").read_text())
    for name in ("decoding-bf16-graphs-run1.json", "serving-bf16-graphs-budget60.json"):
        (tmp_path / name).write_text((folder / name).read_text())
    text = gpu_report.render_gpu_section(tmp_path, tmp_path / "BENCHMARKS.md")
    assert "### Ray Serve on the GPU machine" in text and "**bf16-graphs-budget60**" in text
    assert serving.markdown_table(served) in text
    (tmp_path / "serving-bf16-graphs-budget60.json").unlink()
    assert "Ray Serve" not in gpu_report.render_gpu_section(tmp_path, tmp_path / "BENCHMARKS.md")


def test_the_verify_curve_table_prices_a_batch_by_the_batch1_curve_beside_its_measurement():
    from dart_core.bench import verify_curve

    result = {"curves": {"dense": {"nodes": [1, 2, 4], "ms": [10.0, 12.0, 16.0], "batches": [2],
                                   "batch_ms": [[13.0, 20.0, 30.0]]}}}
    table = verify_curve.markdown_table(result)
    assert "| query tokens per sequence | dense ms | dense ms, batch 2 | dense ms, batch-1 curve at 2·n |" in table
    # batch-1 curve at 2, 4 and 8 tokens: 12, 16 and 16 + 2 ms per token beyond 4 = 24
    assert "| 1 | 10.0 | 13.0 | 12.0 |" in table and "| 4 | 16.0 | 30.0 | 24.0 |" in table


def test_the_speculation_ceiling_follows_its_formula_from_the_timings():
    """chain_speedup: τ(n) = 1 + α + … + α^(n−1) tokens per sequence in ms(n) against one in ms(1); the
    ceiling table's break-even acceptance is ms(2) ÷ ms(1) − 1 and a draft node costs (ms(2) − ms(1)) ÷ B."""
    from dart_core.bench import verify_curve
    from dart_core.spec.budget import chain_speedup

    nodes, ms = [1, 2, 4], [10.0, 15.0, 30.0]
    # α = 1: n = 2 gives 2·10/15, n = 4 gives 4·10/30, the same: the tie goes to fewer nodes
    assert chain_speedup(ms, nodes, 1.0) == (pytest.approx(4 / 3), 2)
    # α = 0.5: n = 2 → 1.5·10/15 = 1.0; n = 4 → 1.875·10/30 = 0.625; n = 1 → 1.0
    assert chain_speedup(ms, nodes, 0.5)[0] == pytest.approx(1.0)
    assert chain_speedup([10.0, 10.5, 12.0], nodes, 0.8) == (pytest.approx(2.952 * 10 / 12), 4)
    assert chain_speedup(ms, nodes, 0.0) == (1.0, 1)
    with pytest.raises(ValueError, match="alpha"):
        chain_speedup(ms, nodes, 1.5)
    with pytest.raises(ValueError, match="include 1"):
        chain_speedup(ms[1:], nodes[1:], 0.5)

    result = {"curves": {"gguf-native": {"nodes": nodes, "ms": [10.0, 10.5, 12.0], "batches": [4],
                                         "batch_ms": [[20.0, 30.0, 50.0]], "format": "4-bit test"}}}
    table = verify_curve.ceiling_table(result, acceptances=(1.0, 0.5))
    # batch 1: 10 ms a token, (10.5 − 10) / 1 = 0.5 ms a node, 0.05 break-even; α = 1 best at n = 4 (40/12)
    assert "| 4-bit test | 1 | 10.00 | 0.50 | 0.05 | 3.33× (4) |" in table
    # batch 4: 5 ms a token, 2.5 ms a node, 0.5 break-even; α = 0.5: n = 2 gives 1.5·20/30 = 1.00, n = 1 1.00
    assert "| 4-bit test | 4 | 5.00 | 2.50 | 0.50 | 1.60× (4) | 1.00× (" in table
    with pytest.raises(ValueError, match="1 and 2"):
        verify_curve.ceiling_table({"curves": {"dense": {"nodes": [1, 4], "ms": [1.0, 2.0]}}})


def test_the_head_ceiling_reads_per_level_acceptance_from_chain_steps_and_prices_it_like_chain_speedup():
    """head_ceiling: α_k = steps accepting ≥ k draft tokens ÷ steps whose chain reached level k with the first
    k − 1 accepted; with one α at every level its ceiling is chain_speedup's; a level never reached ends the chain."""
    from dart_core.bench import head_ceiling
    from dart_core.spec.budget import chain_speedup

    # (draft nodes, accepted draft tokens): 4 chains of 3; one of 2 (clipped at the end of the output)
    steps = [(3, 0), (3, 1), (3, 3), (3, 2), (2, 2)]
    alphas = head_ceiling.chain_acceptance(steps, 4)
    # level 1: 4 accepted of 5; level 2: 3 of 4 (the step that accepted 0 never reached it);
    # level 3: 1 accepted of the 2 three-node chains that accepted 2 (the two-node chain has no level 3); none reached level 4
    assert alphas == [pytest.approx(0.8), pytest.approx(0.75), pytest.approx(0.5), None]
    nodes, ms = [1, 2, 3, 4], [10.0, 10.5, 11.0, 14.0]
    assert head_ceiling.ceiling_at([0.5] * 3, nodes, ms)[:2] == chain_speedup(ms, nodes, 0.5)
    best, n, taus = head_ceiling.ceiling_at(alphas, nodes, ms)
    # τ(n): 1, 1.8, 1.8 + 0.6 = 2.4, 2.4 + 0.3 = 2.7; speed-ups 1, 1.714, 2.182, 1.929
    assert taus == pytest.approx([1.0, 1.8, 2.4, 2.7])
    assert (best, n) == (pytest.approx(2.4 * 10 / 11), 3)
    # nothing past a level never reached: a 2-level chain stops there
    assert head_ceiling.ceiling_at([0.5, None, 0.9], nodes, ms)[2] == pytest.approx([1.0, 1.5, 1.5, 1.5])
    with pytest.raises(ValueError, match="include 1"):
        head_ceiling.ceiling_at(alphas, nodes[1:], ms[1:])
    result = {"config": {"depth": 2, "num_prompts": 8, "max_new_tokens": 128, "repeats": 3},
              "curve": {"nodes": [1, 2, 3], "ms": [6.3, 6.4, 7.3]},
              "rows": [{"dataset": "mt-bench", "alpha": [0.36, None], "chain_tau": 1.36, "ceiling": 1.34, "ceiling_nodes": 2,
                        "shipped_speedup": 1.01, "shipped_speedup_runs": [1.16, 1.0, 1.01], "shipped_tau": 1.12,
                        "share_of_ceiling": 0.754}]}
    table = head_ceiling.markdown_table(result)
    assert "| mt-bench | 0.36 | – | 1.36 | 1.34× (2) | 1.01× (1.16, 1.00, 1.01) | 1.12 | 75% |" in table
    assert head_ceiling.main(["--repeats", "0"]) == 2


def test_the_speculation_ceiling_section_renders_every_kernel_or_names_the_missing_file(tmp_path):
    import json

    from dart_core.bench.sections import CEILING_KERNELS, render_speculation_ceiling

    hardware = {"cpu": "Test CPU", "cpu_count": 2, "cpu_flags": [], "torch": "x", "threads": 2, "python": "3",
                "transformers": "y"}
    for i, kernel in enumerate(CEILING_KERNELS):
        folder = tmp_path / "speculation_ceiling" / kernel
        folder.mkdir(parents=True)
        result = {"config": {"node_counts": [1, 2], "batch_sizes": [1, 4], "repeats": 3}, "hardware": hardware,
                  "curves": {"gguf-native": {"nodes": [1, 2], "ms": [10.0, 10.0 + i], "batches": [4],
                                             "batch_ms": [[20.0, 30.0]], "format": f"fmt {kernel}"}}}
        (folder / "verify_curve.json").write_text(json.dumps(result))
    text = render_speculation_ceiling(tmp_path)
    assert all(f"**{k}** (fmt {k}):" in text for k in CEILING_KERNELS)
    assert text.count("| weights | batch |") == 1  # one ceiling table, a row per kernel and batch size
    assert all(f"| fmt {k} | {b} |" in text for k in CEILING_KERNELS for b in (1, 4))
    (tmp_path / "speculation_ceiling" / CEILING_KERNELS[-1] / "verify_curve.json").unlink()
    with pytest.raises(FileNotFoundError, match=CEILING_KERNELS[-1]):
        render_speculation_ceiling(tmp_path)


def test_the_kernel_default_section_takes_medians_over_runs_and_flags_a_lossy_run(tmp_path):
    """Per qmm kernel: its verification table, one shared ceiling table, then per kernel and dataset
    the median over runs of each figure, and lossless only where every run was; a missing kernel's
    files are named."""
    import json

    from dart_core.bench.sections import KERNEL_DEFAULT_VARIANTS, render_kernel_default

    hardware = {"cpu": "Test CPU", "cpu_count": 2, "cpu_flags": [], "torch": "x", "threads": 2, "python": "3",
                "transformers": "y"}
    folder = tmp_path / "kernel_default"
    for i, kernel in enumerate(("qmm", "qmm-a8")):
        (folder / f"verify_curve-{kernel}").mkdir(parents=True)
        result = {"config": {"node_counts": [1, 2], "batch_sizes": [1], "repeats": 3}, "hardware": hardware,
                  "curves": {"gguf-native": {"nodes": [1, 2], "ms": [10.0, 12.0 - i], "format": f"fmt {kernel}"}}}
        (folder / f"verify_curve-{kernel}" / "verify_curve.json").write_text(json.dumps(result))
    config = {"datasets": ["mt-bench"], "num_prompts": 8, "max_new_tokens": 128, "repeats": 1, "threads": 2,
              "budget": "auto"}

    def run(ar: float, dart: float, lossless: bool = True) -> dict:
        step = {"draft": 1.0, "tree_search": 0.2, "verify": 6.0, "total": 8.0}
        return {"config": config, "rows": [
            {"dataset": "mt-bench", "method": "autoregressive", "tokens_per_s": ar, "speedup": 1.0, "tau": 1.0,
             "ms_per_step": step, "lossless": True},
            {"dataset": "mt-bench", "method": "dart-context", "tokens_per_s": dart, "speedup": dart / ar, "tau": 2.0,
             "ms_per_step": step, "lossless": lossless}]}

    for prefix, _ in KERNEL_DEFAULT_VARIANTS:
        for r, (ar, dart) in enumerate([(100.0, 120.0), (110.0, 99.0), (90.0, 180.0)], 1):
            lossy = prefix == "auto" and r == 2
            (folder / f"{prefix}-r{r}.json").write_text(json.dumps(run(ar, dart, not lossy)))
    text = render_kernel_default(tmp_path)
    assert "**qmm** (fmt qmm):" in text and "**qmm-a8** (fmt qmm-a8):" in text
    assert text.count("| weights | batch |") == 1
    # medians: autoregressive 100, DART 120, DART ÷ autoregressive median(1.2, 0.9, 2.0) = 1.2
    assert "| qmm (float32 activations) | mt-bench | 100.0 | 120.0 | 1.20× | 2.00 | 1.00 | 8.00 | yes |" in text
    assert "| qmm-a8 (the new default here) | mt-bench | 100.0 | 120.0 | 1.20× | 2.00 | 1.00 | 8.00 | **NO** |" in text
    for f in folder.glob("auto-r*.json"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="auto"):
        render_kernel_default(tmp_path)


def test_the_schema_set_holds_valid_examples_and_the_grammar_table_reports_every_engine(tmp_path):
    """Every example instance of the JSON-schema set validates against its schema (jsonschema), and
    the grammar-engine table has one row per engine, whether measured, missing or failed."""
    import jsonschema

    from dart_core.bench import grammar_engines

    rows = [json.loads(x) for x in grammar_engines.DEFAULT_SCHEMAS.read_text().splitlines() if x.strip()]
    assert len(rows) == 20 and len({r["name"] for r in rows}) == 20
    for r in rows:
        jsonschema.validate(r["example"], r["schema"])
        assert r["prompt"]
    measured = {"installed": True, "version": "1.0", "tokenizer_setup_ms": 12.0, "schemas": 20, "compiled": 20,
                "examples_accepted": 19, "compile_ms_median": 3.5, "compile_ms_max": 40.0, "mask_us_median": 25.0,
                "mask_us_p90": 60.0, "masks": 400, "fork_us_median": 2.0, "errors": [],
                "offers": {"fork": "fork()", "rollback": "rollback(n)", "forced": "ff()"}}
    table = grammar_engines.markdown_table({"engines": {
        "xgrammar": measured, "llguidance": {"installed": False},
        "outlines-core": {"installed": True, "version": "0.2", "error": "TypeError: bad vocabulary"}}})
    assert "| xgrammar | 1.0 | 12 | 3.5 / 40.0 | 25.0 / 60.0 | 2.0 | 19 of 20 | `fork()` |" in table
    assert "| llguidance | not installed |" in table and "| outlines-core | 0.2 | failed: TypeError" in table
    with pytest.raises(ValueError, match="unknown engine"):
        grammar_engines.measure_engines(engines=("nope",))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"name": "x", "schema": {}}) + "\n")
    with pytest.raises(ValueError, match="'schema' and 'example'"):
        grammar_engines.measure_engines(bad, engines=())


def test_structured_output_benchmark_on_a_tiny_model(tiny_model_dir, tmp_path):
    """Every mode runs on the same schemas, DART equals constrained autoregressive decoding, the mask
    cost is counted, and the page block is written around hand-written text."""
    from dart_core.bench import structured

    schemas = tmp_path / "s.jsonl"
    rows = [{"name": "flag", "prompt": "Is it on?", "schema": {"type": "object", "properties": {"on": {"type": "boolean"}},
                                                              "required": ["on"], "additionalProperties": False}},
            {"name": "pick", "prompt": "Pick.", "schema": {"enum": ["red", "green", "blue"]}}]
    schemas.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = structured.measure_in_process(schemas, model=tiny_model_dir, head="random", max_tokens=24, runs=1,
                                           progress=False)
    assert set(result["modes"]) == set(structured.MODES) and result["schemas"] == 2
    for mode, r in result["modes"].items():
        assert r["equal_to_autoregressive"] == 2 and r["valid"] == 2, (mode, r)
        assert r["masks_per_token"] > 0 and r["mask_us"] > 0 and r["tokens_per_s"] > 0
    assert result["modes"]["dart"]["tau"] > 1.0  # the forced keys and brackets are drafted
    assert all(p["equal"] for p in result["per_schema"])
    page = tmp_path / "B.md"
    page.write_text("# Benchmarks\n\nkept text\n")
    path = tmp_path / "out"
    assert structured.main(["--schemas", str(schemas), "--model", tiny_model_dir, "--head", "random", "--runs", "1",
                            "--max-tokens", "24", "--out", str(path), "--page", str(page)]) == 0
    text = page.read_text()
    assert "kept text" in text and structured.START in text and "| dart |" in text
    assert json.loads((path / "structured.json").read_text())["schemas"] == 2


def test_the_served_structured_benchmark_keeps_several_requests_in_flight(tmp_path, monkeypatch):
    """measure_served against a stand-in server (httpx.MockTransport): with --concurrency 3 up to
    three requests are in flight at once, every schema is asked in both modes and at T = 0.8, the
    results say their concurrency, and the file is named after it."""
    import threading

    import httpx

    from dart_core.bench import structured

    schemas = tmp_path / "s.jsonl"
    rows = [{"name": f"s{i}", "prompt": "x", "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                       "required": ["n"]}} for i in range(6)]
    schemas.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    lock, live, peak, asked = threading.Lock(), [0], [0], []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            asked.append((body["speculative"], body["temperature"]))
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return httpx.Response(200, json={"choices": [{"message": {"content": '{"n": 1}'}}],
                                         "usage": {"completion_tokens": 4, "dart": {"tau": 2.0}}})

    real = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    result = structured.measure_served("http://stand-in/v1", schemas, runs=1, progress=False, concurrency=3)
    assert peak[0] == 3 and len(asked) == 3 * len(rows)
    assert result["config"]["concurrency"] == 3 and result["equal"] == len(rows)
    assert result["modes"]["dart"]["valid"] == len(rows) and result["sampled"]["valid"] == len(rows)
    assert "(served, 3 clients)" in structured.markdown_table(result)
    with pytest.raises(ValueError, match="concurrency"):
        structured.measure_served("http://stand-in/v1", schemas, concurrency=0)


def test_guidellm_report_keeps_the_figures_that_matter(tmp_path):
    from dart_core.bench import guidellm_report

    def metric(median, count=8):
        return {"successful": {"median": median, "count": count, "total_sum": median * count}}

    bench = {"config": {"strategy": {"type_": "concurrent", "streams": 4},
                        "backend": {"target": "http://h:8000", "model": "m", "request_format": "/v1/chat/completions"}},
             "metrics": {"request_totals": {"successful": 8, "errored": 0, "incomplete": 1},
                         "output_token_count": metric(64), "time_to_first_token_ms": metric(250.0),
                         "inter_token_latency_ms": metric(80.0), "request_latency": metric(5.5)},
             "duration": 51.2}
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"metadata": {"guidellm_version": "0.8.1"}, "benchmarks": [bench]}))
    page = tmp_path / "B.md"
    page.write_text("# B\n")
    assert guidellm_report.main([str(path), "--out", str(tmp_path / "o"), "--page", str(page)]) == 0
    row = json.loads((tmp_path / "o" / "guidellm.json").read_text())["rows"][0]
    assert row == {"strategy": "concurrent", "streams": 4, "completed": 8, "errored": 0, "incomplete": 1,
                   "duration_s": 51.2, "output_tokens_per_s": 10.0, "ttft_ms_median": 250.0, "itl_ms_median": 80.0,
                   "latency_s_median": 5.5}
    assert "| 4 | 8 | 0 | 1 | 10.0 |" in page.read_text()
    (tmp_path / "bad.json").write_text("{}")
    assert guidellm_report.main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "o")]) == 2


def test_the_serving_threads_table_reads_loader_threads_and_run_from_file_names(tmp_path):
    import json

    from dart_core.bench.sections import render_serving_threads

    folder = tmp_path / "serving_threads"
    folder.mkdir()
    rows = [{"concurrency": 4, "mode": "dart", "tokens_per_s": 90.0},
            {"concurrency": 4, "mode": "no-speculation", "tokens_per_s": 60.0}]
    (folder / "own-thread-omp2-r1.json").write_text(json.dumps({"rows": rows}))
    table = render_serving_threads(tmp_path)
    assert "| on a thread that ends (`load_in_own_thread`) | 2 | 4 | r1 | 90.0 | 60.0 | 1.50× |" in table
    (folder / "omp2.json").write_text(json.dumps({"rows": rows}))
    with pytest.raises(ValueError, match="omp2.json"):
        render_serving_threads(tmp_path)
    with pytest.raises(FileNotFoundError):
        render_serving_threads(tmp_path / "nowhere")


def test_the_stream_interval_table_takes_medians_over_runs_per_setting(tmp_path):
    import json

    from dart_core.bench.sections import STREAM_VARIANTS, render_stream_interval

    folder = tmp_path / "stream_interval"
    folder.mkdir()
    config = {"concurrency": [1], "requests_per_client": 4, "max_tokens": 128, "modes": ["no-speculation"],
              "dataset": "alpacaeval"}

    def run(tps, ttft):
        return json.dumps({"config": config, "rows": [{"concurrency": 1, "mode": "no-speculation",
                                                       "tokens_per_s": tps, "ttft_ms": {"p50": ttft}}]})

    for prefix, _ in STREAM_VARIANTS[:-1]:
        (folder / f"{prefix}-r1.json").write_text(run(100.0, 80.0))
    with pytest.raises(FileNotFoundError, match="interval-50"):
        render_stream_interval(tmp_path)
    for i, tps in enumerate((120.0, 150.0, 130.0), 1):  # median 130
        (folder / f"interval-50-r{i}.json").write_text(run(tps, 70.0 + i))
    table = render_stream_interval(tmp_path)
    assert "| 1 | no-speculation | 100.0 | 100.0 | 100.0 | 130.0 | 1.30× | 80 | 72 |" in table
    assert "50 ms 3" in table


def test_the_draft_weights_table_takes_medians_over_runs_per_setting(tmp_path):
    import json

    from dart_core.bench.sections import DRAFT_WEIGHT_SETTINGS, render_draft_weights

    folder = tmp_path / "draft_weights"
    folder.mkdir()
    config = {"datasets": ["alpacaeval"], "num_prompts": 4, "max_new_tokens": 32, "threads": 2, "budget": "auto"}
    hardware = {"cpu": "Test CPU", "cpu_count": 2, "cpu_flags": [], "torch": "x", "threads": 2, "python": "3",
                "transformers": "y"}

    def run(dart_tps, speedup, tau=1.5):
        steps = {"draft": 1.0, "tree_search": 0.1, "verify": 5.0, "total": 6.5}
        return json.dumps({"config": config, "hardware": hardware, "rows": [
            {"method": "autoregressive", "tokens_per_s": 100.0, "speedup": 1.0, "tau": 1.0, "ms_per_step": steps},
            {"method": "dart-context", "tokens_per_s": dart_tps, "speedup": speedup, "tau": tau,
             "ms_per_step": steps}]})

    for setting in DRAFT_WEIGHT_SETTINGS:
        for i, tps in enumerate((110.0, 130.0, 120.0), 1):  # median 120
            (folder / f"{setting}-r{i}.json").write_text(run(tps, tps / 100))
    with pytest.raises(FileNotFoundError, match="tau60"):
        render_draft_weights(tmp_path)
    for setting in DRAFT_WEIGHT_SETTINGS:
        (folder / f"tau60-{setting}.json").write_text(run(50.0, 0.5, tau=2.5))
    table = render_draft_weights(tmp_path)
    assert "| q8_0 | 120.0 | 100.0 | 1.20× | 1.00 | 6.50 | 1.50 | 2.50 |" in table


def test_log_level_option_sets_dart_serves_own_loggers(tmp_path):
    """``--log-level debug`` (every in-process benchmark CLI) turns on the engine's step-by-step gate log and
    leaves other libraries' loggers alone."""
    import argparse
    import dataclasses
    import logging

    from dart_core.bench import add_engine_arguments, run_cli

    @dataclasses.dataclass
    class Cfg:
        device: str = "cpu"

    ap = argparse.ArgumentParser()
    add_engine_arguments(ap, argparse.Namespace(model=None, head=None, trie="auto", budget="auto", dtype="float32",
                                                weights="auto", device="cpu", threads=None))
    ap.add_argument("--out", default=str(tmp_path))
    ap.add_argument("--no-progress", action="store_true")
    engine_logger, other = logging.getLogger("dart_core.step.engine"), logging.getLogger("urllib3")
    saved = (logging.getLogger("dart_core").level, logging.getLogger("ngram_service").level, other.level)
    try:
        assert run_cli(Cfg, ap.parse_args(["--log-level", "debug"]), lambda cfg, progress: {"rows": []},
                       lambda result, out: {}, lambda result: "") == 0
        assert engine_logger.isEnabledFor(logging.DEBUG)
        assert logging.getLogger("ngram_service").level == logging.DEBUG
        assert other.level == saved[2]
        with pytest.raises(SystemExit):
            ap.parse_args(["--log-level", "verbose"])
    finally:
        logging.getLogger("dart_core").setLevel(saved[0])
        logging.getLogger("ngram_service").setLevel(saved[1])


def test_gate_replay_reads_the_engine_log_and_replays_it(tmp_path):
    """``dart_core.bench.gate_replay``: the engine's debug lines parsed into step pools (unmeasured speculative
    steps as catch-ups, other batch sizes ignored); fixed choices give each pool's own rate; a gate speculates
    where speculation pays and mostly not where it is slowed down; a log without gated steps is an error."""
    from dart_core.bench.gate_replay import read_steps, render, replay
    from dart_core.step.engine import GATE_LOG

    def line(batch, mode, tokens, ms, measured=True):  # a record as the engine logs it
        return "x DEBUG dart_core.step.engine: " + GATE_LOG % (batch, mode, tokens, ms, ms - 1, 4, "" if measured else
                                                          ", not measured", None)

    log = tmp_path / "gate.log"
    lines = [line(1, "speculative", 3, 10.0)] * 5 + [line(1, "speculative", 2, 20.0, measured=False)]
    lines += [line(1, "autoregressive", 1, 8.0)] * 5 + [line(4, "autoregressive", 4, 9.0), "unrelated line"]
    log.write_text("\n".join(lines))
    steps = read_steps([log])
    assert (len(steps.speculative), len(steps.autoregressive), steps.catch_up) == (5, 5, [(2, 20.0)])
    assert replay(steps, True, num_steps=50) == (pytest.approx(0.3, rel=0.05), 1.0)  # one catch-up at most: none
    assert replay(steps, False, num_steps=50) == (pytest.approx(1 / 8), 0.0)
    rate, share = replay(steps, {}, num_steps=500)
    assert share > 0.9 and rate > 0.25
    rate, share = replay(steps, {}, num_steps=500, slowdown=4.0)  # 3 tokens in 40 ms against 1 in 8: speculation loses
    assert share < 0.2
    assert "| as measured | 200 | shipped (ema 0.02, warmup 8, settle 1, probe 4) |" in render([log], seeds=2, num_steps=200)
    # cold steps: the speculative steps right after each autoregressive stretch get their own pool
    cold = tmp_path / "cold.log"
    block = [line(1, "autoregressive", 1, 8.0)] * 3 + [line(1, "speculative", 1, 40.0, measured=False),
                                                       line(1, "speculative", 1, 30.0)] + [line(1, "speculative", 3, 10.0)] * 4
    cold.write_text("\n".join(block * 6))
    steps = read_steps([cold])
    assert steps.pool(True, 1) == [(1, 30.0)] * 6 and steps.pool(True, 2) == [(3, 10.0)] * 6
    assert steps.pool(True, 5) is steps.speculative and steps.pool(False, 0) == [(1, 8.0)] * 6
    table = render([cold], seeds=2, num_steps=300)
    assert "speculative 1" in table and "| 1.5× slower for 100 steps, then as measured | 300 | always speculate |" in table
    # speculation slowed for the first third only: the gate speculates less than where it pays throughout
    paying = statistics.mean(replay(steps, {}, num_steps=900, seed=s)[1] for s in range(4))
    changing = statistics.mean(replay(steps, {}, num_steps=900, seed=s, slowdown=4.0, slow_steps=300)[1] for s in range(4))
    assert changing < paying
    empty = tmp_path / "empty.log"
    empty.write_text("nothing logged\n")
    with pytest.raises(ValueError, match="no gated"):
        read_steps([empty])


def test_the_traffic_workload_is_classed_by_what_came_before_and_summarised_per_class(tmp_path):
    """dart_core.bench.traffic: a request is a repeat of a prompt sent before, a variant of a family
    seen before, or first; the built workload comes from the tuning split (no benchmark-set prompt),
    with every class present; the summary takes tokens over seconds per class and the table gives
    the ratios the live corpus is judged by."""
    from dart_core.bench import traffic
    from dart_core.bench.datasets import load_prompts

    kinds = [r["kind"] for r in traffic.classify([{"prompt": "a", "family": "f"}, {"prompt": "b", "family": "f"},
                                                  {"prompt": "a", "family": "f"}, {"prompt": "c"}])]
    assert kinds == ["first", "variant", "repeat", "first"]
    work = traffic.build_workload(families=2, variants=3, repeated=2, repeat_times=3)
    assert len(work) == 2 * 3 + 2 * 3 and {r["kind"] for r in work} == set(traffic.KINDS)
    bench = set(load_prompts("mt-bench"))
    assert not any(r["prompt"] in bench for r in work)
    (tmp_path / "w.jsonl").write_text('{"prompt": "x"}\n\n{"prompt": "x"}\n')
    assert [r["kind"] for r in traffic.load_workload(tmp_path / "w.jsonl")] == ["first", "repeat"]
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        traffic.load_workload(tmp_path / "bad.jsonl")
    records = [{"kind": "first", "tokens": 10, "seconds": 2.0, "decode_seconds": 1.0, "tau": 1.0, "steps": 9,
                "speculative_steps": 0, "speculative_tokens": 0},
               {"kind": "repeat", "tokens": 10, "seconds": 1.0, "decode_seconds": 0.5, "tau": 5.0, "steps": 4,
                "speculative_steps": 2, "speculative_tokens": 7}]
    s = traffic.summarise(records)
    assert s["first"]["tokens_per_s"] == 5.0 and s["repeat"]["decode_tokens_per_s"] == 18.0
    assert s["later"]["requests"] == 1 and s["all"]["tokens_per_s"] == round(20 / 3, 2)
    # τ over speculative steps: their tokens ÷ their count, autoregressive steps left out
    assert s["first"]["tau_speculative"] is None and s["first"]["speculative_share"] == 0.0
    assert s["repeat"]["tau_speculative"] == 3.5 and s["all"]["speculative_share"] == round(2 / 13, 3)
    med = {"median": 1.0, "runs": [1.0]}
    result = {"model": "m", "config": {"max_tokens": 8, "passes": 1}, "hardware": {"line": "cpu"}, "lossless": True,
              "search_latency": None,
              "summary": {m: {"repeat": {"tokens_per_s": {"median": v, "runs": [v]},
                                         "decode_tokens_per_s": {"median": 2 * v, "runs": [2 * v]},
                                         "tau": med, "tau_speculative": {"median": v / 10, "runs": [v / 10]},
                                         "requests": 1}}
                          for m, v in (("learn-on", 30.0), ("learn-off", 20.0), ("no-speculation", 10.0))}}
    table = traffic.markdown_table(result)
    assert "| repeat | 1 | 30.0, 60.0, 1.00, 3.00 |" in table and "| 1.00× | 1.50× | 3.00× | 3.00× |" in table
    for m in result["summary"].values():  # a result from before τ over speculative steps was recorded
        del m["repeat"]["tau_speculative"]
    table = traffic.markdown_table(result)
    assert "| repeat | 1 | 30.0, 60.0, 1.00 |" in table and "| 1.00× | 3.00× | 3.00× |" in table
    # learning on ÷ off within each pass: pass 1's servers ran at half the speed of pass 0's
    fast = [{"kind": "first", "tokens": 10, "seconds": 1.0, "decode_seconds": 1.0, "tau": 2.0}]
    slow = [{"kind": "first", "tokens": 10, "seconds": 2.0, "decode_seconds": 2.0, "tau": 2.0}]
    slower = [{"kind": "first", "tokens": 10, "seconds": 2.5, "decode_seconds": 2.5, "tau": 1.0}]
    result["passes"] = [{"learn-on": fast, "learn-off": fast}, {"learn-off": slow, "learn-on": slower},
                        {"no-speculation": fast}]
    assert traffic.paired_ratios(result) == {"tokens/s": [1.0, 0.8], "τ": [1.0, 0.5]}
    assert "tokens/s 1.00, 0.80 (median 0.90×); τ 1.00, 0.50 (median 0.75×)" in traffic.markdown_table(result)
    assert "paired by pass" not in traffic.markdown_table(result, paired=False)


def test_the_traffic_benchmark_reads_the_engines_stats_through_a_child_driver_or_says_it_cannot(monkeypatch, caplog):
    """dart_core.bench.traffic.engine_stats: the engine's counters come back as the child Ray
    driver printed them (its last line: Ray may print before it), for the application named in
    the Serve config; a child that fails or prints no JSON gives None and a warning, never an
    exception in the middle of a benchmark."""
    import subprocess

    from dart_core.bench import traffic

    assert traffic._first_app("deployments/dart.yaml")["name"] == "dart"
    seen = []

    def child(args, **kwargs):
        seen.append(args[-1])
        return subprocess.CompletedProcess(args, 0, stdout='connecting\n{"speculative_steps": 3}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", child)
    assert traffic.engine_stats("dart") == {"speculative_steps": 3} and seen == ["dart"]

    def failing(args, **kwargs):
        raise subprocess.CalledProcessError(1, args, stderr="no cluster")

    for run in (failing, lambda args, **kw: subprocess.CompletedProcess(args, 0, stdout="", stderr="")):
        monkeypatch.setattr(subprocess, "run", run)
        with caplog.at_level("WARNING", logger="dart_core.bench.traffic"):
            assert traffic.engine_stats("dart") is None
        assert "cannot read the engine's stats" in caplog.text
        caplog.clear()


def test_the_interleaved_traffic_config_holds_one_application_per_mode_that_serve_can_place():
    """dart_core.bench.traffic.interleaved_config: the shipped config's application once per mode,
    each at its own route and name, learning only for learn-on, the n-gram services on distinct
    ports, the scheduling shares divided so that the applications together ask for what one asked
    for, and the engines' idle re-measurements staggered; everything else as shipped.  Interleaving
    needs --serve, and an unknown mode is refused."""
    import yaml

    from dart_core.bench import traffic

    shipped = yaml.safe_load(open("deployments/dart.yaml"))
    base = shipped["applications"][0]
    modes = ["learn-on", "learn-off", "no-speculation"]
    cfg = traffic.interleaved_config("deployments/dart.yaml", modes)
    apps = cfg["applications"]
    assert [a["name"] for a in apps] == [f"dart-{m}" for m in modes]
    assert [a["route_prefix"] for a in apps] == [f"/{m}" for m in modes]
    assert [a["args"]["ngram"]["learn"] for a in apps] == [True, False, False]
    ports = [a["args"]["ngram"]["port"] for a in apps]
    assert ports[0] == base["args"]["ngram"]["port"] and len(set(ports)) == 3
    afters = [a["args"]["recalibrate_after_s"] for a in apps]
    assert min(b - a for a, b in zip(afters, afters[1:])) >= traffic.RECALIBRATE_STAGGER_S
    for dep_i, dep in enumerate(base["deployments"]):
        cpus = (dep.get("ray_actor_options") or {}).get("num_cpus")
        if cpus is not None:
            assert sum(a["deployments"][dep_i]["ray_actor_options"]["num_cpus"] for a in apps) == pytest.approx(cpus)
    for a in apps:  # the rest of the application is the shipped one
        assert ({k: v for k, v in a["args"].items() if k not in ("ngram", "recalibrate_after_s")}
                == {k: v for k, v in base["args"].items() if k not in ("ngram", "recalibrate_after_s")})
        assert a["import_path"] == base["import_path"]
    assert {k: v for k, v in cfg.items() if k != "applications"} == {
        k: v for k, v in shipped.items() if k != "applications"}
    with pytest.raises(ValueError, match="modes must be among"):
        traffic.interleaved_config("deployments/dart.yaml", ["learn-on", "sideways"])
    with pytest.raises(ValueError, match="interleave needs serve"):
        traffic.run_traffic(traffic.TrafficConfig(interleave=True), progress=False)
