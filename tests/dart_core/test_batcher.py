"""The Ray-free continuous batcher: outputs equal the engine's under concurrent
submission, admission respects the batch limit, cancellation frees the slot,
stop strings and characters split over steps come out right, a request that
opts out of speculation steps autoregressively, bad requests are refused
before queueing, and logprobs are the target's."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from dart_core.api import DartModel
from dart_core.serve.batcher import BatcherConfig, BatcherObserver, ContinuousBatcher
from dart_core.step.engine import StepOutput
from dart_core.serve.request import ChatMessage, GenerationRequest, InvalidRequest
from dart_core.step.sampling import SamplingParams

from .conftest import OracleTreeSearch

PROMPTS = ["The capital of France", "def fib(n):", "Once upon a time", "1, 2, 3,", "Roses are red",
           "import numpy as np", "Dear Sir or Madam,"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return DartModel.from_pretrained(tiny_model_dir, head="random", trie=None, budget=6)


def engine_output(model, prompt: str, n: int, speculative: bool = True) -> list[int]:
    ids = model.encode(prompt)
    return model.engine.generate([ids], model.sampling_params(max_new_tokens=n), speculative=speculative).token_ids[0]


class Recorder(BatcherObserver):
    def __init__(self) -> None:
        self.batch_sizes: list[int] = []
        self.finished = 0

    def on_step(self, step: StepOutput, prefill: bool) -> None:
        if not prefill:
            self.batch_sizes.append(len(step.seq_ids))

    def on_finish(self, chunk) -> None:
        self.finished += 1


def wait_idle(batcher, timeout_s: float = 10.0) -> None:
    """Waits until no sequence runs (a request ended by a stop string or a cancel leaves at the
    engine's next step, after its last chunk went out)."""
    deadline = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        if batcher.stats()["running"] == 0:
            return
        deadline.wait(0.05)
    raise AssertionError(f"still running: {batcher.stats()}")


def run_all(batcher, requests):
    """Submits every request from its own thread at once; returns each one's chunks."""
    results = [None] * len(requests)

    def one(i):
        results[i] = list(batcher.generate(requests[i], timeout_s=120))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_requests_equal_the_engine_and_respect_the_batch_limit(model):
    n = 12
    wants = [engine_output(model, p, n) for p in PROMPTS]
    full = [model.encode(p) + w for p, w in zip(PROMPTS, wants)]
    saved, model.engine.tree_search = model.engine.tree_search, OracleTreeSearch(full, depth=4)  # multi-token steps
    rec = Recorder()
    try:
        with ContinuousBatcher(model.engine, model.tokenizer, BatcherConfig(max_batch_size=3), rec) as b:
            results = run_all(b, [GenerationRequest(prompt=p, max_tokens=n) for p in PROMPTS])
            wait_idle(b)
    finally:
        model.engine.tree_search = saved
    for chunks, want, prompt in zip(results, wants, PROMPTS):
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == want
        assert "".join(c.text for c in chunks) == model.tokenizer.decode(want, skip_special_tokens=True)
        last = chunks[-1]
        assert last.finish_reason == "length" and last.completion_tokens == n
        assert last.prompt_tokens == len(model.encode(prompt)) and all(c.finish_reason is None for c in chunks[:-1])
        assert last.steps >= 1 and last.step_tokens == n - 1  # the first token comes from the prefill
    assert max(rec.batch_sizes) == 3 and rec.finished == len(PROMPTS)
    assert max(c.tau for r in results for c in r[-1:]) > 1.5  # the oracle's drafts were accepted


def test_chat_messages_use_the_chat_template(model):
    msgs = (ChatMessage("user", "Hello there"),)
    ids = model.encode([{"role": "user", "content": "Hello there"}])
    want = model.engine.generate([ids], model.sampling_params(max_new_tokens=5)).token_ids[0]
    with ContinuousBatcher(model.engine, model.tokenizer) as b:
        chunks = list(b.generate(GenerationRequest(messages=msgs, max_tokens=5)))
    assert [t for c in chunks for t in c.token_ids] == want and chunks[-1].prompt_tokens == len(ids)


def test_cancellation_frees_the_slot_and_leaves_the_others_exact(model):
    want = engine_output(model, PROMPTS[0], 10)
    with ContinuousBatcher(model.engine, model.tokenizer, BatcherConfig(max_batch_size=2)) as b:
        long = b.generate(GenerationRequest(prompt=PROMPTS[1], max_tokens=200))
        first = next(long)
        assert first.finish_reason is None
        long.close()  # the consumer goes away: the request is cancelled
        chunks = list(b.generate(GenerationRequest(prompt=PROMPTS[0], max_tokens=10)))
        assert [t for c in chunks for t in c.token_ids] == want
        wait_idle(b)


def test_stop_strings_end_the_request_and_trim_the_text(model):
    want = model.tokenizer.decode(engine_output(model, PROMPTS[2], 16), skip_special_tokens=True)
    at = next(i for i in range(1, len(want) - 3) if want.find(want[i:i + 3]) == i)  # a first occurrence
    stop = want[at:at + 3]
    with ContinuousBatcher(model.engine, model.tokenizer) as b:
        chunks = list(b.generate(GenerationRequest(prompt=PROMPTS[2], max_tokens=200, stop=("\x00never", stop))))
        assert "".join(c.text for c in chunks) == want[:at]
        assert chunks[-1].finish_reason == "stop"
        wait_idle(b)  # the engine dropped the sequence at once, not after 200 tokens
        s = b.stats()
        assert s["speculative_steps"] + s["autoregressive_steps"] <= 17


def test_opting_out_of_speculation_steps_autoregressively(model):
    want = engine_output(model, PROMPTS[3], 8, speculative=False)
    with ContinuousBatcher(model.engine, model.tokenizer) as b:
        before = b.stats()
        chunks = list(b.generate(GenerationRequest(prompt=PROMPTS[3], max_tokens=8, speculative=False)))
        after = b.stats()
    assert [t for c in chunks for t in c.token_ids] == want
    assert after["autoregressive_steps"] - before["autoregressive_steps"] == 7
    assert after["speculative_steps"] == before["speculative_steps"] and chunks[-1].tau == 1.0


def test_finished_requests_reach_the_learning_hook_unless_they_opt_out(model):
    """on_sequence gets each finished request's prompt and generated token ids, from the engine
    thread; a request with learn=False, or one cancelled, never reaches it."""
    class Learner(BatcherObserver):
        def __init__(self) -> None:
            self.seen: list[tuple[list[int], list[int]]] = []

        def on_sequence(self, prompt, output) -> None:
            self.seen.append((list(prompt), list(output)))

    rec = Learner()
    with ContinuousBatcher(model.engine, model.tokenizer, observer=rec) as b:
        kept = list(b.generate(GenerationRequest(prompt=PROMPTS[0], max_tokens=9)))
        list(b.generate(GenerationRequest(prompt=PROMPTS[1], max_tokens=9, learn=False)))
        handle = b.submit(GenerationRequest(prompt=PROMPTS[2], max_tokens=200), lambda item: None)
        handle.cancel()
        wait_idle(b)
    assert rec.seen == [(model.encode(PROMPTS[0]), [t for c in kept for t in c.token_ids])]


def test_bad_requests_are_refused_before_queueing(model):
    cfg = BatcherConfig(max_tokens_limit=32)
    with ContinuousBatcher(model.engine, model.tokenizer, cfg) as b:
        with pytest.raises(InvalidRequest, match="limit of 32"):
            b.submit(GenerationRequest(prompt="hi", max_tokens=33), lambda item: None)
        with pytest.raises(InvalidRequest, match="context"):
            b.submit(GenerationRequest(prompt="word " * 600), lambda item: None)
        assert b.queued == 0
    for bad in (dict(), dict(prompt="a", messages=(ChatMessage("user", "b"),)), dict(prompt=""),
                dict(prompt="a", temperature=-1), dict(prompt="a", top_p=0), dict(prompt="a", max_tokens=0),
                dict(prompt="a", stop=("1", "2", "3", "4", "5")), dict(prompt="a", speculative="no"),
                dict(prompt="a", logprobs=21), dict(prompt="a", learn=1)):
        with pytest.raises(InvalidRequest):
            GenerationRequest(**bad)


@pytest.mark.parametrize("speculative", [True, False])
def test_logprobs_are_the_targets(model, speculative):
    prompt = model.encode(PROMPTS[4])
    with ContinuousBatcher(model.engine, model.tokenizer) as b:
        chunks = list(b.generate(GenerationRequest(prompt=PROMPTS[4], max_tokens=6, logprobs=3,
                                                   speculative=speculative)))
    tokens = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs]
    assert [e.token_id for e in entries] == tokens
    with torch.no_grad():
        logits = model.engine.target.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1)
    for i, e in enumerate(entries):
        assert e.logprob == pytest.approx(float(ref[i, e.token_id]), abs=1e-4)
        assert [t for t, _, _ in e.top] == ref[i].topk(3).indices.tolist()
        assert e.top[0][0] == e.token_id  # greedy: the chosen token is the most likely one
        assert e.token == model.tokenizer.decode([e.token_id])


class ScriptedEngine:
    """:meth:`DartEngine.generate_stream`'s protocol (admit, cancelled, finish reasons) with scripted
    output: a sequence whose prompt is ``p`` emits ``scripts[tuple(p)]``, ``per_step`` tokens a step."""

    def __init__(self, scripts: dict, per_step: int = 1) -> None:
        self.scripts = scripts
        self.per_step = per_step
        self.target = types.SimpleNamespace(max_context=4096)

    @staticmethod
    def _emit(seq, n):
        out = []
        while seq["todo"] and len(out) < n:
            out.append(seq["todo"].pop(0))
            if len(seq["out"]) + len(out) >= seq["sampling"].max_new_tokens:
                return out, "length"
        return out, None if seq["todo"] else "stop"

    def generate_stream(self, prompts, sampling, *, speculative=True, admit=None, cancelled=(),
                        max_speculative_batch=None):
        seqs, next_id = {}, 0
        while True:
            joining = admit() if admit else []
            if joining:
                ids = list(range(next_id, next_id + len(joining)))
                next_id += len(joining)
                toks, reasons = [], []
                for sid, x in zip(ids, joining):
                    seqs[sid] = {"todo": list(self.scripts[tuple(x.prompt)]), "out": [], "sampling": x.sampling}
                    t, r = self._emit(seqs[sid], 1)
                    seqs[sid]["out"] += t
                    toks.append(t)
                    reasons.append(r)
                yield StepOutput(seq_ids=ids, new_tokens=toks, finish_reasons=reasons,
                                 accepted_lengths=[0] * len(ids), draft_nodes=[0] * len(ids), num_nodes=0,
                                 draft_ms=0.0, tree_search_ms=0.0, verify_ms=0.0, step_ms=0.0)
                seqs = {k: v for k, v in seqs.items() if k not in [i for i, r in zip(ids, reasons) if r]}
                continue
            gone = [sid for sid in seqs if sid in cancelled]
            if gone:
                yield StepOutput(seq_ids=gone, new_tokens=[[] for _ in gone],
                                 finish_reasons=["cancelled"] * len(gone), accepted_lengths=[0] * len(gone),
                                 draft_nodes=[0] * len(gone), num_nodes=0, draft_ms=0.0, tree_search_ms=0.0,
                                 verify_ms=0.0, step_ms=0.0)
                seqs = {k: v for k, v in seqs.items() if k not in gone}
            if not seqs:
                return
            ids = list(seqs)
            out = [self._emit(seqs[sid], self.per_step) for sid in ids]
            for sid, (t, _) in zip(ids, out):
                seqs[sid]["out"] += t
            yield StepOutput(seq_ids=ids, new_tokens=[t for t, _ in out], finish_reasons=[r for _, r in out],
                             accepted_lengths=[len(t) for t, _ in out],
                             draft_nodes=[self.per_step - 1] * len(ids), num_nodes=self.per_step, draft_ms=0.0,
                             tree_search_ms=0.0, verify_ms=0.0, step_ms=0.0)
            seqs = {k: v for (k, v), (_, r) in zip(list(seqs.items()), out) if r is None}


@pytest.mark.parametrize("per_step", [1, 2, 3])
def test_characters_split_over_steps_and_stop_strings_across_steps(default_tokenizer, per_step):
    tok = default_tokenizer
    text = "Parrot: 🦜 漢字, then END of story"
    script = tok(text, add_special_tokens=False)["input_ids"]
    prompt = tok("go", add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine({tuple(prompt): script}, per_step=per_step)
    with ContinuousBatcher(engine, tok) as b:
        chunks = list(b.generate(GenerationRequest(prompt="go", max_tokens=100)))
        assert "".join(c.text for c in chunks) == text
        assert all("\ufffd" not in c.text for c in chunks)  # no chunk shows half a character
        assert [t for c in chunks for t in c.token_ids] == script
        cut = list(b.generate(GenerationRequest(prompt="go", max_tokens=100, stop=("END",))))
        assert "".join(c.text for c in cut) == "Parrot: 🦜 漢字, then " and cut[-1].finish_reason == "stop"
        wait_idle(b)


def test_a_closed_batcher_refuses_requests(model):
    b = ContinuousBatcher(model.engine, model.tokenizer).start()
    b.close()
    with pytest.raises(RuntimeError, match="not running"):
        b.submit(GenerationRequest(prompt="hi"), lambda item: None)


def test_sampling_parameters_have_a_public_constructor(model):
    s = model.sampling_params(max_new_tokens=5, temperature=0.5, logprobs=2)
    assert s.stop_token_ids == (model.tokenizer.eos_token_id,) and s.logprobs == 2
    assert SamplingParams.stopping_at(None, max_new_tokens=3).stop_token_ids == ()
    assert SamplingParams.stopping_at(7, stop_token_ids=(1,)).stop_token_ids == (1,)


def test_per_step_figures_add_up_to_the_requests_totals(model):
    """Each chunk says how many draft tokens its verification step accepted, how large the tree
    was and how much of its text the bonus token made; the totals are the sums."""
    n = 16
    want = engine_output(model, PROMPTS[1], n)
    saved, model.engine.tree_search = model.engine.tree_search, OracleTreeSearch([model.encode(PROMPTS[1]) + want],
                                                                                 depth=4)
    try:
        with ContinuousBatcher(model.engine, model.tokenizer) as b:
            chunks = list(b.generate(GenerationRequest(prompt=PROMPTS[1], max_tokens=n)))
            plain = list(b.generate(GenerationRequest(prompt=PROMPTS[1], max_tokens=n, speculative=False)))
    finally:
        model.engine.tree_search = saved
    assert [t for c in chunks for t in c.token_ids] == want == [t for c in plain for t in c.token_ids]
    first, steps, last = chunks[0], chunks[1:], chunks[-1]
    assert (first.accepted, first.draft_nodes, first.bonus_chars, len(first.token_ids)) == (0, 0, 0, 1)  # prefill
    for c in steps:  # (a step may draft no tree: the last token before max_tokens needs none)
        assert 0 <= c.accepted <= min(c.draft_nodes, len(c.token_ids))
        if c.finish_reason is None and c.draft_nodes:  # a full step: its accepted drafts, then the bonus token
            assert c.accepted == len(c.token_ids) - 1
            assert c.text.endswith(model.tokenizer.decode(c.token_ids[-1:])) and c.bonus_chars > 0
    assert sum(c.draft_nodes > 0 for c in steps) >= len(steps) - 1
    assert any(c.accepted >= 2 for c in steps)  # the oracle's chains were accepted
    assert last.accepted_tokens == sum(c.accepted for c in chunks) and last.accepted_tokens > 0
    assert last.draft_tokens == sum(c.draft_nodes for c in chunks)
    assert last.steps == len(steps) and last.step_tokens == sum(len(c.token_ids) for c in steps)
    # speculation off: one target token per step, no draft tree, no bonus token
    assert all((c.accepted, c.draft_nodes, c.bonus_chars) == (0, 0, 0) for c in plain)
    assert plain[-1].draft_tokens == plain[-1].accepted_tokens == 0 and plain[-1].tau == 1.0


@pytest.mark.parametrize("per_step", [2, 3])
def test_bonus_characters_are_the_last_tokens_text(default_tokenizer, per_step):
    tok = default_tokenizer
    text = "alpha beta gamma delta epsilon zeta eta theta"
    script = tok(text, add_special_tokens=False)["input_ids"]
    prompt = tok("go", add_special_tokens=False)["input_ids"]
    with ContinuousBatcher(ScriptedEngine({tuple(prompt): script}, per_step=per_step), tok) as b:
        chunks = list(b.generate(GenerationRequest(prompt="go", max_tokens=100)))
    assert "".join(c.text for c in chunks) == text
    for c in chunks[1:]:
        assert c.draft_nodes == per_step - 1 and c.accepted == len(c.token_ids) - 1
        assert c.text[len(c.text) - c.bonus_chars:] == tok.decode(c.token_ids[-1:]) and c.bonus_chars > 0


def test_vllm_sampling_extensions(model):
    """ignore_eos, stop_token_ids, include_stop_str_in_output and skip_special_tokens with vLLM's
    meaning; min_tokens holds the stop token back (not taken with stop strings)."""
    ids = engine_output(model, PROMPTS[2], 12)
    want = model.tokenizer.decode(ids, skip_special_tokens=True)
    eos = model.tokenizer.eos_token_id
    with ContinuousBatcher(model.engine, model.tokenizer) as b:
        # a stop token id ends the output after that token, which stays in the output
        cut = max(i for i in range(len(ids)) if ids[i] not in ids[:i])  # a first occurrence
        chunks = list(b.generate(GenerationRequest(prompt=PROMPTS[2], max_tokens=12, stop_token_ids=(ids[cut],))))
        assert [t for c in chunks for t in c.token_ids] == ids[:cut + 1] and chunks[-1].finish_reason == "stop"
        # the stop string kept in the text
        at = next(i for i in range(1, len(want) - 3) if want.find(want[i:i + 3]) == i)
        kept = list(b.generate(GenerationRequest(prompt=PROMPTS[2], max_tokens=12, stop=(want[at:at + 3],),
                                                 include_stop_str_in_output=True)))
        assert "".join(c.text for c in kept) == want[:at + 3]
        # ignore_eos: the EOS token no longer ends the output (the sampling's stop ids lose it)
        plain = b.sampling_params(GenerationRequest(prompt="x", max_tokens=4), 1)
        ignoring = b.sampling_params(GenerationRequest(prompt="x", max_tokens=4, ignore_eos=True,
                                                       stop_token_ids=(3,)), 1)
        assert eos in plain.stop_token_ids and ignoring.stop_token_ids == (3,)
        fixed = list(b.generate(GenerationRequest(prompt=PROMPTS[2], max_tokens=10, min_tokens=10, ignore_eos=True)))
        assert fixed[-1].completion_tokens == 10 and fixed[-1].finish_reason == "length"
        # min_tokens past the stop token id: the output runs on beyond where it stopped above
        held = list(b.generate(GenerationRequest(prompt=PROMPTS[2], max_tokens=12, stop_token_ids=(ids[cut],),
                                                 min_tokens=cut + 2)))
        out = [t for c in held for t in c.token_ids]
        assert len(out) >= cut + 2 and ids[cut] not in out[:cut + 1]
    for bad, needle in (({"min_tokens": 3, "stop": ("x",)}, "not supported together with stop strings"),
                        ({"min_tokens": 5, "ignore_eos": True, "max_tokens": 4}, "min_tokens must be <="),
                        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
                        ({"ignore_eos": "yes"}, "ignore_eos")):
        with pytest.raises(InvalidRequest, match=needle):
            GenerationRequest(prompt="x", **bad)


def _os_threads() -> int:
    """The process's OS threads once their count has held for 0.3 s (up to 5 s): threads of
    earlier tests may still be ending, and an ended thread's OpenMP workers exit a moment after it."""
    import os

    last, since = len(os.listdir("/proc/self/task")), time.monotonic()
    deadline = since + 5
    while time.monotonic() < deadline and time.monotonic() - since < 0.3:
        time.sleep(0.02)
        now = len(os.listdir("/proc/self/task"))
        if now != last:
            last, since = now, time.monotonic()
    return last


@pytest.mark.skipif(torch.get_num_threads() < 2 or not __import__("os").path.isdir("/proc/self/task"),
                    reason="needs 2 intra-op threads and Linux's /proc to count OpenMP workers")
def test_a_model_loaded_in_its_own_thread_leaves_no_openmp_pool_behind():
    """What the Serve deployment loads its model with: the loading thread's OpenMP worker pool ends
    with it (a pool left on a thread that stays would make the engine thread's the second one; see
    load_in_own_thread), while a thread that stays keeps its workers; results and errors come back."""
    from dart_core.serve.batcher import load_in_own_thread

    def parallel_work():
        return float(torch.ones(1 << 22).exp().sum())  # large enough to run on every intra-op thread

    before = _os_threads()
    assert load_in_own_thread(parallel_work) == pytest.approx(float(1 << 22) * 2.718281828, rel=1e-4)
    assert _os_threads() <= before  # nothing left behind (other tests' threads may have ended meanwhile)
    with pytest.raises(ZeroDivisionError):
        load_in_own_thread(lambda: 1 / 0)
    stop = threading.Event()
    base = _os_threads()
    stays = threading.Thread(target=lambda: (parallel_work(), stop.wait()))
    stays.start()
    try:
        assert _os_threads() >= base + 2  # the thread and at least one OpenMP worker of its own
    finally:
        stop.set()
        stays.join()


@pytest.mark.parametrize("interval_s", [0.0, 0.05, 10.0])
def test_grouped_streaming_keeps_every_chunk_and_sends_the_first_alone(model, interval_s):
    """agenerate_batches (what the Serve deployment streams): the same chunks as generate, in
    order, grouped into lists; the first list is the prefill's chunk alone, and with an interval
    longer than the whole generation the rest arrive as one list that ends with the last chunk
    (the last chunk is not held back for the interval)."""
    import asyncio

    n = 12
    with ContinuousBatcher(model.engine, model.tokenizer) as b:
        want = list(b.generate(GenerationRequest(prompt=PROMPTS[2], max_tokens=n)))

        async def collect():
            started = time.perf_counter()
            lists = [batch async for batch in b.agenerate_batches(GenerationRequest(prompt=PROMPTS[2], max_tokens=n),
                                                                  interval_s)]
            return lists, time.perf_counter() - started

        lists, seconds = asyncio.run(collect())
    chunks = [c for batch in lists for c in batch]
    assert [c.token_ids for c in chunks] == [c.token_ids for c in want]
    assert [c.text for c in chunks] == [c.text for c in want] and chunks[-1].finish_reason == "length"
    assert all(batch for batch in lists) and len(lists[0]) == 1 and lists[0][0].steps == 0
    if interval_s == 10.0:
        assert len(lists) == 2 and seconds < interval_s


def test_grouped_streaming_interval_grows_with_the_open_streams(model):
    """With ``items_per_s`` (the replica's cap on lists per second over all its streams) each
    stream's interval is the open streams ÷ that cap where longer than ``interval_s``: two streams
    at 0.1 lists per second wait 20 s between lists, so each sends its first chunk alone and the
    rest as one list ending with the last chunk; with no stream open the interval is
    ``interval_s`` again, and without a cap it never changes."""
    import asyncio

    n = 12
    with ContinuousBatcher(model.engine, model.tokenizer) as b:
        want = list(b.generate(GenerationRequest(prompt=PROMPTS[2], max_tokens=n)))
        assert b.stream_interval(0.05, None) == b.stream_interval(0.05, 0) == 0.05
        assert b.stream_interval(0.05, 0.1) == 0.05  # no stream open

        async def one(seen: list):
            lists = []
            async for batch in b.agenerate_batches(GenerationRequest(prompt=PROMPTS[2], max_tokens=n), 0.0, 0.1):
                seen.append(b.stream_interval(0.0, 0.1))
                lists.append(batch)
            return lists

        async def collect():
            seen: list = []
            started = time.perf_counter()
            results = await asyncio.gather(one(seen), one(seen))
            return results, seen, time.perf_counter() - started

        results, seen, seconds = asyncio.run(collect())
        assert b.stream_interval(0.0, 0.1) == 0.0
    assert 20.0 in seen and seconds < 20.0
    for lists in results:
        assert len(lists) == 2 and len(lists[0]) == 1 and lists[0][0].steps == 0
        assert [c.token_ids for batch in lists for c in batch] == [c.token_ids for c in want]
        assert lists[-1][-1].finish_reason == "length"


def test_grouped_streaming_raises_after_the_chunks_before_a_failure(model, monkeypatch):
    """A generation that fails in the engine after some steps: the chunks before the failure
    arrive, then the error; an invalid request raises before any list."""
    import asyncio

    real = model.engine.generate_stream

    def failing(*args, **kwargs):
        for i, step in enumerate(real(*args, **kwargs)):
            if i == 3:
                raise RuntimeError("boom")
            yield step

    with ContinuousBatcher(model.engine, model.tokenizer) as b:
        monkeypatch.setattr(model.engine, "generate_stream", failing)

        async def collect(request):
            got = []
            with pytest.raises((RuntimeError, InvalidRequest)) as e:
                async for batch in b.agenerate_batches(request, 10.0):
                    got.append(batch)
            return got, e.value

        got, error = asyncio.run(collect(GenerationRequest(prompt=PROMPTS[0], max_tokens=20)))
        assert "boom" in str(error) and [len(batch) for batch in got] == [1, 2]  # the prefill, then 2 steps
        got, error = asyncio.run(collect(GenerationRequest(prompt="x", max_tokens=10 ** 6)))
        assert isinstance(error, InvalidRequest) and got == []


def test_an_idle_engine_remeasures_its_verification_curve_once(tiny_model_dir):
    """With an adaptive budget, the first idle second after ``recalibrate_after_s`` measures the
    verification cost curve again (once); decoding afterwards is unchanged."""
    auto = DartModel.from_pretrained(tiny_model_dir, head="random", trie=None)
    budget = auto.engine.budget
    assert budget is not None and budget.remeasured == 0
    with pytest.raises(ValueError, match="recalibrate_after_s"):
        BatcherConfig(recalibrate_after_s=-1)
    with ContinuousBatcher(auto.engine, auto.tokenizer, BatcherConfig(recalibrate_after_s=0)) as b:
        for _ in range(200):
            if budget.remeasured:
                break
            time.sleep(0.05)
        assert budget.remeasured == 1
        req = GenerationRequest(prompt=PROMPTS[0], max_tokens=12, temperature=0.0)
        tokens = [t for chunk in b.generate(req, timeout_s=60) for t in chunk.token_ids]
        time.sleep(2.0)  # idle again: no second re-measurement
        assert budget.remeasured == 1
    assert tokens == auto.engine.generate([auto.encode(PROMPTS[0])], auto.sampling_params(max_new_tokens=12),
                                          speculative=False).token_ids[0]
