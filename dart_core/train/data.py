"""Self-distillation data for the draft head (DART issue 5; docs/design.md §2 "Training").

Prompts are ShareGPT first turns (deduplicated, MT-Bench, HumanEval and — with
``exclude_alpacaeval``, the default — AlpacaEval prompts removed,
:func:`ngram_service.corpus.sharegpt_first_prompts`), shuffled with a seed.
Each prompt goes through the target's chat template and the **target itself**
writes the response (greedy, with dart-serve's own engine: continuous
batching of ``generate_batch_size`` sequences, packed linear layers on a
CPU), so the head learns the distribution it will be asked to predict.  Each
response is appended to ``responses.jsonl`` in the data folder as soon as it
is finished; a rerun skips the prompts already answered (resumable), and a
truncated last line from a killed run is ignored.

Record: ``{"index": i, "prompt_ids": [...], "response_ids": [...]}`` where
``response_ids`` ends with the EOS token when the target stopped by itself.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

__all__ = ["DataConfig", "Example", "generate_responses", "answer_prompts", "prompt_examples",
           "unanswered_prompts", "chat_prompt_ids", "load_examples", "training_prompts", "sharegpt_examples",
           "SHAREGPT_INDEX_BASE", "LATER_TURN_INDEX_BASE", "is_teacher_forced", "later_turn_prompts",
           "write_examples", "read_examples", "stored_examples"]

RESPONSES = "responses.jsonl"
#: Example indices of the teacher-forced ShareGPT source start here (self-distilled ones are prompt indices).
SHAREGPT_INDEX_BASE = 10_000_000
#: Example indices of the later-turn self-distilled source (the target's answers to ShareGPT's later human turns).
LATER_TURN_INDEX_BASE = 20_000_000


def is_teacher_forced(index: int) -> bool:
    """Whether an example index belongs to the teacher-forced ShareGPT source (the others are the
    target's own answers: first-turn prompt indices, or later turns from :data:`LATER_TURN_INDEX_BASE`)."""
    return SHAREGPT_INDEX_BASE <= index < LATER_TURN_INDEX_BASE


_ROLES = {"human": "user", "gpt": "assistant"}


@dataclass(frozen=True)
class DataConfig:
    num_prompts: int = 4000  # prompts to answer
    max_prompt_tokens: int = 256  # longer prompts (after the chat template) are skipped
    max_new_tokens: int = 256  # response length cap
    generate_batch_size: int = 64  # sequences decoded together (continuous batching)
    prompt_seed: int = 0  # prompt shuffle
    eval_prompts: int = 64  # held out (the first ones of the shuffled list), never trained on
    exclude_alpacaeval: bool = True  # drop AlpacaEval instructions too (fetches the alpaca-eval sdist once)
    sharegpt_turns: int = 0  # teacher-forced source: ShareGPT's own assistant turns (0 = none)
    sharegpt_skip: int = 0  # teacher-forced turns to pass over first (fresh data for a warm start)
    prompt_skip: int = 0  # prompts below this index are not answered or loaded (fresh data), the held-out ones stay
    later_turns: int = 0  # self-distilled source 2: the target answers ShareGPT's 2nd and later human turns, the
    # conversation before them as context (0 = none); about as many again as the first turns at 1,024 prompt tokens
    later_turns_skip: int = 0  # later-turn prompts to pass over first (fresh data for a warm start)
    generate: bool = True  # False: train on the responses already stored; unanswered prompts are left out
    examples_file: str | None = None  # pre-tokenized examples (.npz, write_examples): used instead of both sources


@dataclass(frozen=True)
class Example:
    index: int
    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def training_prompts(config: DataConfig) -> list[str | None]:
    """The shuffled prompt list: the first ``num_prompts`` of it are answered,
    of which the first ``eval_prompts`` form the held-out slice.

    With ``exclude_alpacaeval`` the entries whose conversation quotes an
    AlpacaEval instruction are ``None`` rather than removed: the list is
    shuffled before that filter, so a prompt keeps its index with either
    setting and a data folder stays usable when the setting changes (its
    answers to excluded prompts are then ignored).  ``prompt_skip`` makes the entries from
    ``eval_prompts`` to ``prompt_skip - 1`` ``None`` the same way (the prompts an earlier run
    answered, for a warm start on fresh ones), keeping the held-out ones."""
    from ngram_service.corpus import sharegpt_first_prompt_lists, sharegpt_first_prompts

    if config.exclude_alpacaeval:
        every, kept = sharegpt_first_prompt_lists()  # one pass over ShareGPT, kept for the process
        prompts = list(every)
    else:
        prompts, kept = list(sharegpt_first_prompts(exclude_alpacaeval=False)), None
    random.Random(config.prompt_seed).shuffle(prompts)
    prompts = prompts[: config.num_prompts]
    if kept is not None:
        prompts = [p if p in kept else None for p in prompts]
    if config.prompt_skip:  # a warm start's fresh prompts: those a previous run used are passed over
        prompts = [p if i < config.eval_prompts or i >= config.prompt_skip else None for i, p in enumerate(prompts)]
    return prompts


def _records(path: Path) -> dict[int, dict]:
    """index -> record of ``responses.jsonl`` (lines cut off by a killed run skipped)."""
    rows = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
                r = {"index": int(r["index"]), "prompt_ids": list(r["prompt_ids"]),
                     "response_ids": list(r["response_ids"])}
                rows[r["index"]] = r
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    return rows


def _ends_mid_line(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            return False
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """``text`` as one user message through the target's chat template, generation prompt added."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def prompt_examples(config: DataConfig, folder: str | Path, tokenizer,
                    prompts: list[str | None] | None = None, later: list[Example] | None = None) -> list[Example]:
    """The training prompts (below ``num_prompts``, excluded ones left out) as prompt-only examples
    (``response_ids == []``) through the chat template, in list order, for :func:`answer_prompts`:
    those longer than ``max_prompt_tokens`` are left out unless ``folder`` holds an answer to them
    (which :func:`answer_prompts` then checks against the prompt).  With no tokenizer (a test
    target) the answered ones are left out too, there being nothing to check them against."""
    return _prompt_examples(config, _records(Path(folder) / RESPONSES), tokenizer, prompts, later,
                            answered=tokenizer is not None)


def unanswered_prompts(config: DataConfig, folder: str | Path, tokenizer,
                       prompts: list[str | None] | None = None, later: list[Example] | None = None) -> list[Example]:
    """:func:`prompt_examples` that ``folder`` holds no answer to: what ``gpu_recipe pack
    --generate-there`` sends to be answered on another machine."""
    return _prompt_examples(config, _records(Path(folder) / RESPONSES), tokenizer, prompts, later, answered=False)


def _prompt_examples(config: DataConfig, done: dict[int, dict], tokenizer, prompts: list[str | None] | None,
                     later: list[Example] | None, *, answered: bool) -> list[Example]:
    """:func:`prompt_examples` given the stored answers ``done``; ``answered=False`` leaves out (and
    does not tokenize) the prompts answered there.  ``prompts`` / ``later``: :func:`training_prompts`
    and :func:`later_turn_prompts` of ``config`` when the caller has them already."""
    out = []
    for i, text in enumerate(training_prompts(config) if prompts is None else prompts):
        if text is None or (i in done and not answered):
            continue  # an excluded prompt (an old answer to it is not loaded), or an answered one not asked for
        ids = chat_prompt_ids(tokenizer, text)
        if i in done or len(ids) <= config.max_prompt_tokens:
            out.append(Example(i, ids, []))
    if config.later_turns and tokenizer is not None:  # the second self-distilled source, after the first turns
        later = later_turn_prompts(tokenizer, config) if later is None else later
        out += [e for e in later if answered or e.index not in done]
    return out


@torch.inference_mode()
def generate_responses(target, config: DataConfig, folder: str | Path, *, progress: bool = True,
                       prompts: list[str | None] | None = None) -> Path:
    """Answers the training prompts with the target (resumable); returns the JSONL path.

    Args:
        target: a :class:`dart_core.model.target.TargetModel` with its tokenizer.
        folder: data folder; ``responses.jsonl`` is appended there.
        prompts: :func:`training_prompts` of ``config`` when the caller has it already.

    Raises:
        ValueError: the folder holds answers to other prompts (another seed,
            corpus or tokenizer) under the same indices.
    """
    answer_prompts(target, prompt_examples(config, folder, target.tokenizer, prompts), folder, config,
                   progress=progress)
    return Path(folder) / RESPONSES


@torch.inference_mode()
def answer_prompts(target, prompts: list[Example], folder: str | Path, config: DataConfig, *,
                   progress: bool = True, deadline: float | None = None) -> bool:
    """Greedy answers of the target to tokenized prompts, appended to ``folder/responses.jsonl``
    under each prompt's index (resumable: prompts answered there already are skipped; every other
    prompt is answered, the caller chose them: :func:`prompt_examples`, or a packed set).
    ``config.generate_batch_size`` sequences are decoded together (continuous batching with
    dart-serve's engine, no draft head), at most ``config.max_new_tokens`` tokens each.

    Args:
        prompts: :class:`Example` s whose ``prompt_ids`` are the chat-templated prompt (responses ignored).
        deadline: a ``time.time()`` value: past it no prompt joins the batch any more (the answers
            in flight still finish, at most ``max_new_tokens`` steps); every call admits at least one
            batch, so repeated calls always make progress.

    Returns:
        True when every prompt is answered, False when the deadline left some for a later call.

    Raises:
        ValueError: the folder holds answers to other prompts (another seed,
            corpus or tokenizer) under the same indices.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / RESPONSES
    tok = target.tokenizer
    done = _records(out)
    todo = []
    for e in prompts:
        if e.index in done:
            if done[e.index]["prompt_ids"] != list(e.prompt_ids):
                raise ValueError(f"{out} answers another prompt under index {e.index} (a different prompt seed, "
                                 "corpus or tokenizer); use another work directory or remove that file")
            continue
        todo.append((e.index, list(e.prompt_ids)))
    if not todo:
        return True
    # prompts join in list order (continuous batching: a finished answer's slot goes to the next
    # prompt at the next step), so a run stopped early holds about a prefix of the list (give that
    # prefix's size as num_prompts to use it); answers are written as they finish
    from dart_core.step.engine import DartEngine, NewSequence
    from dart_core.step.sampling import SamplingParams

    eos = None if tok is None else tok.eos_token_id
    sampling = SamplingParams(max_new_tokens=config.max_new_tokens, stop_token_ids=() if eos is None else (eos,))
    engine = DartEngine(target)  # no draft head: plain greedy decoding, the target's own answers
    queue = list(reversed(todo))
    running: dict[int, tuple[int, list[int]]] = {}  # seq id -> (prompt index, prompt ids)
    next_id = 0

    def admit() -> list[NewSequence]:
        nonlocal next_id
        joining = []
        if next_id and deadline is not None and time.time() > deadline:
            return joining  # past the deadline: let the batch drain (the first batch always joins)
        # joining copies the batch's KV cache once: let a few slots free up first (a quarter of the batch)
        if running and config.generate_batch_size - len(running) < max(1, config.generate_batch_size // 4):
            return joining
        while queue and len(running) < config.generate_batch_size:  # running holds the joining ones too
            i, ids = queue.pop()
            running[next_id + len(joining)] = (i, ids)
            joining.append(NewSequence(ids, sampling))
        next_id += len(joining)
        return joining

    bar = tqdm(total=len(todo), desc="self-distilled responses", unit="prompt", disable=not progress)
    new_tokens, t0 = 0, time.perf_counter()
    answers: dict[int, list[int]] = {}
    with open(out, "a", encoding="utf-8") as f:
        if _ends_mid_line(out):
            f.write("\n")  # end the line a killed run left unfinished
        for step in engine.generate_stream([], sampling, admit=admit):
            for sid, toks, reason in zip(step.seq_ids, step.new_tokens, step.finish_reasons):
                answers.setdefault(sid, []).extend(toks)
                new_tokens += len(toks)
                if reason is None:
                    continue
                i, ids = running.pop(sid)
                resp = answers.pop(sid)
                f.write(json.dumps({"index": i, "prompt_ids": ids, "response_ids": resp}) + "\n")
                f.flush()
                bar.update(1)
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    seconds = time.perf_counter() - t0
    logger.info("self-distilled responses: %d of %d answered this call, %d new tokens in %.0f s (%.0f tokens/s)",
                len(todo) - len(queue), len(todo), new_tokens, seconds, new_tokens / max(seconds, 1e-9))
    if queue:
        logger.info("self-distilled responses: time limit, %d prompts left for the next call (resumable)", len(queue))
    return not queue


def load_examples(folder: str | Path, limit: int | None = None,
                  prompts: list[str | None] | None = None) -> list[Example]:
    """Reads ``responses.jsonl`` (sorted by prompt index; cut-off lines skipped),
    keeping prompt indices below ``limit`` when given, and with ``prompts``
    (:func:`training_prompts`) only the indices whose prompt is not ``None``.

    Raises:
        FileNotFoundError: no responses in the folder.
    """
    path = Path(folder) / RESPONSES
    if not path.is_file():
        raise FileNotFoundError(f"no self-distilled responses at {path}; generate them first")
    return _first_turn_examples(_records(path), limit, prompts)


def _first_turn_examples(rows: dict[int, dict], limit: int | None,
                         prompts: list[str | None] | None) -> list[Example]:
    """:func:`load_examples` given the records of ``responses.jsonl``."""
    keep = [k for k in sorted(rows) if (limit is None or k < limit)
            and (prompts is None or (k < len(prompts) and prompts[k] is not None))]
    return [Example(k, rows[k]["prompt_ids"], rows[k]["response_ids"]) for k in keep]


def _chat_conversations(config: DataConfig, seed: int) -> list[list[dict]]:
    """ShareGPT conversations as chat messages (``{"role", "content"}``), shuffled with ``seed``:
    those quoting an evaluation prompt (AlpacaEval's too with ``exclude_alpacaeval``), those whose
    first prompt is a held-out one (the first ``eval_prompts`` of :func:`training_prompts`) and those
    with roles other than human/gpt alternating from a human turn are left out."""
    from ngram_service.corpus import clean_sharegpt_conversations, normalise_text

    held_out = {normalise_text(p) for p in training_prompts(config)[: config.eval_prompts] if p is not None}
    out = []
    for turns in clean_sharegpt_conversations(None, True, config.exclude_alpacaeval):
        if not turns or normalise_text(turns[0]["value"]) in held_out:
            continue
        roles = [_ROLES.get(t.get("from")) for t in turns]
        if None in roles or any(r != ("user", "assistant")[i % 2] for i, r in enumerate(roles)):
            continue
        out.append([{"role": r, "content": t["value"]} for r, t in zip(roles, turns)])
    random.Random(seed).shuffle(out)
    return out


def _template(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def sharegpt_examples(tokenizer, config: DataConfig) -> list[Example]:
    """The teacher-forced source: ShareGPT's own assistant turns, as the target's chat template
    puts them, for a target forward to label (its distributions over text it did not write).

    Conversations are shuffled with ``prompt_seed + 1``; each assistant turn becomes one example:
    the conversation up to it through the chat template (with the generation prompt) as the
    prompt, its text plus EOS as the response (anchors lie in the response only).  Turns whose
    prompt exceeds ``max_prompt_tokens`` are skipped; of the turns kept, the first
    ``sharegpt_skip`` are passed over and the next ``sharegpt_turns`` returned.  Conversations
    whose first prompt is a held-out one (the first ``eval_prompts`` of
    :func:`training_prompts`) or that quote an evaluation prompt are left out, as are
    conversations with roles other than human/gpt alternating from a human turn.  Example
    indices are ``SHAREGPT_INDEX_BASE + k`` for the k-th turn kept, counting the skipped ones, so
    a turn has the same index whatever ``sharegpt_skip`` is (``--sharegpt-skip 3300
    --sharegpt-turns 2400`` gives the 2,400 turns that follow a ``--sharegpt-turns 3300`` run).
    """
    if config.sharegpt_turns <= 0:
        return []
    eos = tokenizer.eos_token_id
    out: list[Example] = []
    kept = 0  # turns kept so far, the skipped ones included
    for messages in _chat_conversations(config, config.prompt_seed + 1):
        for i in range(1, len(messages), 2):
            prompt = _template(tokenizer, messages[:i])
            if len(prompt) > config.max_prompt_tokens:
                break  # later turns only grow the history
            response = tokenizer(messages[i]["content"].strip(), add_special_tokens=False)["input_ids"]
            if not response:
                continue
            kept += 1
            if kept <= config.sharegpt_skip:
                continue
            out.append(Example(SHAREGPT_INDEX_BASE + kept - 1, prompt,
                               response[: config.max_new_tokens] + ([eos] if eos is not None else [])))
            if len(out) >= config.sharegpt_turns:
                return out
    logger.warning("ShareGPT gave %d teacher-forced turns of the %d asked for (after skipping %d)", len(out),
                   config.sharegpt_turns, config.sharegpt_skip)
    return out


def later_turn_prompts(tokenizer, config: DataConfig) -> list[Example]:
    """The later-turn prompts, prompt-only (``response_ids == []``): for :func:`answer_prompts`,
    whose greedy answers make a second self-distilled source next to the first turns of
    :func:`training_prompts`, for runs that have used those up.  The pool grows with
    ``max_prompt_tokens``, as the history does: of ShareGPT's 26.2 k later human turns (in
    11.0 k usable conversations), about 2.2 k fit in 256 tokens, 6.7 k in 512 and 14.5 k in 1,024
    (a 3,000-prompt sample, SmolLM2's template), against 13.0 k and 14.6 k first turns at 256 and
    1,024.

    Conversations are those of the teacher-forced source (:func:`sharegpt_examples`: evaluation
    quotes, held-out first prompts and odd roles left out), shuffled with ``prompt_seed + 2``.
    Each human turn after the first becomes one prompt: the conversation up to it (ShareGPT's
    own earlier assistant turns as the history) through the chat template, with the generation
    prompt.  Prompts over ``max_prompt_tokens`` end their conversation (later turns only grow the
    history); of the prompts kept, the first ``later_turns_skip`` are passed over and the next
    ``later_turns`` returned.  Indices are ``LATER_TURN_INDEX_BASE + k`` for the k-th prompt kept,
    counting the skipped ones, so a prompt keeps its index whatever ``later_turns_skip`` is.
    """
    if config.later_turns <= 0:
        return []
    out: list[Example] = []
    kept = 0
    for messages in _chat_conversations(config, config.prompt_seed + 2):
        for i in range(2, len(messages), 2):  # messages[i] is a human turn after the first
            if not messages[i]["content"].strip():
                continue
            prompt = _template(tokenizer, messages[: i + 1])
            if len(prompt) > config.max_prompt_tokens:
                break
            kept += 1
            if kept <= config.later_turns_skip:
                continue
            out.append(Example(LATER_TURN_INDEX_BASE + kept - 1, prompt, []))
            if len(out) >= config.later_turns:
                return out
    logger.warning("ShareGPT gave %d later-turn prompts of the %d asked for (after skipping %d)", len(out),
                   config.later_turns, config.later_turns_skip)
    return out


def write_examples(examples: list[Example], path: str | Path) -> Path:
    """Saves examples as one compressed ``.npz`` of plain arrays (no pickle): ``tokens`` (all
    sequences concatenated, uint16 when every id fits, else int32), ``offsets`` [S + 1],
    ``prompt_lengths`` [S] and ``indices`` [S] (example indices, which keep the held-out split and
    the source: :func:`is_teacher_forced`).  About 2 bytes per token
    before compression: how the training data travels to a machine without the data packages."""
    path = Path(path)
    ids = [e.ids for e in examples]
    top = max((max(x) for x in ids if x), default=0)
    tokens = np.fromiter((t for x in ids for t in x), dtype=np.uint16 if top <= np.iinfo(np.uint16).max else np.int32)
    offsets = np.zeros(len(examples) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, tokens=tokens, offsets=offsets,
                        prompt_lengths=np.array([len(e.prompt_ids) for e in examples], dtype=np.int64),
                        indices=np.array([e.index for e in examples], dtype=np.int64))
    return path


def read_examples(path: str | Path) -> list[Example]:
    """The examples of a :func:`write_examples` file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not such an archive or its arrays disagree (a corrupt or foreign file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no examples file at {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            tokens, offsets = z["tokens"], z["offsets"]
            prompt_lengths, indices = z["prompt_lengths"], z["indices"]
    except (KeyError, OSError, ValueError) as e:
        raise ValueError(f"{path} is not an examples file (tokens, offsets, prompt_lengths, indices): {e}") from None
    n = len(indices)
    if (len(offsets) != n + 1 or len(prompt_lengths) != n or offsets[0] != 0 or offsets[-1] != len(tokens)
            or np.any(np.diff(offsets) < 0) or np.any(prompt_lengths > np.diff(offsets))):
        raise ValueError(f"{path}: inconsistent examples arrays (corrupt file?)")
    out = []
    for i in range(n):
        seq = tokens[offsets[i]: offsets[i + 1]].astype(np.int64).tolist()
        p = int(prompt_lengths[i])
        out.append(Example(int(indices[i]), seq[:p], seq[p:]))
    return out


def stored_examples(config: DataConfig, folder: str | Path, tokenizer,
                    prompts: list[str | None] | None = None, later: list[Example] | None = None) -> list[Example]:
    """Every example of a data configuration, nothing generated: the self-distilled responses
    stored in ``folder`` (below ``num_prompts``, excluded prompts left out; none when the folder
    has no responses) and those to the ``later_turns`` prompts answered there (with a tokenizer),
    then ``sharegpt_turns`` teacher-forced turns (with a tokenizer).  Examples whose response is
    shorter than 2 tokens (no anchor) are dropped.

    Raises:
        ValueError: the folder answers another later-turn prompt under one of the indices.

    Args:
        prompts: :func:`training_prompts` of ``config`` when the caller has it already.
        later: :func:`later_turn_prompts` of ``config`` when the caller has it already.
    """
    examples = []
    if (Path(folder) / RESPONSES).is_file():
        rows = _records(Path(folder) / RESPONSES)
        examples = _first_turn_examples(rows, config.num_prompts,
                                        training_prompts(config) if prompts is None else prompts)
        if config.later_turns and tokenizer is not None:
            for e in later_turn_prompts(tokenizer, config) if later is None else later:
                if e.index not in rows:
                    continue  # not answered (yet): left out, as unanswered first turns are
                if rows[e.index]["prompt_ids"] != e.prompt_ids:
                    raise ValueError(f"{Path(folder) / RESPONSES} answers another later-turn prompt under index "
                                     f"{e.index} (a different prompt seed, corpus or tokenizer)")
                examples.append(Example(e.index, e.prompt_ids, rows[e.index]["response_ids"]))
    if config.sharegpt_turns and tokenizer is not None:
        examples += sharegpt_examples(tokenizer, config)
    return [e for e in examples if len(e.response_ids) >= 2]
