"""Structured output: grammars compiled by llguidance, and each sequence's grammar state.

A request may constrain its output to a JSON schema, any JSON object, a regular
expression or a list of choices (:class:`GrammarSpec`; OpenAI's
``response_format`` and vLLM's ``guided_*`` fields map onto it).  The engine
replica compiles the spec once per distinct spec (:class:`GrammarCompiler`,
an LRU cache, each compile under a time limit and llguidance's own resource
limits) into a :class:`Grammar`; every sequence that uses it decodes with its
own :class:`GrammarState`, a copy of the compiled matcher.

How the engine uses the state (docs/engine.md, "Structured output"):

- **Verification** masks the target's logits at every tree node the acceptance
  walk visits by the grammar state after that node's path
  (:func:`~dart_core.step.verify.accept_constrained`), so constrained DART output is
  constrained plain decoding's output: equal at temperature 0, equally
  distributed above it.  The bonus token is constrained too.
- **Drafting** (:meth:`GrammarState.draft_tree`) drops every draft node whose
  path the grammar forbids, and adds the tokens the grammar forces (a schema's
  fixed keys, punctuation, closing brackets) as a chain with acceptance
  estimate 1, after the root and after the most probable surviving path.

JSON is written compactly with ``", "`` and ``": "`` separators (no free
whitespace, which a small model can otherwise repeat until ``max_tokens``).
The grammar engine is llguidance (chosen by measurement: ``bench/results/grammar_engines/``); no grammar code is our own.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ngram_service.tree_search import DraftTree

__all__ = ["GrammarError", "GrammarSpec", "GrammarCompiler", "grammar_tokenizer", "Grammar", "GrammarState",
           "MinTokens", "row_constraint", "JSON_OPTIONS", "GRAMMAR_KINDS"]

#: how JSON is laid out under a schema (llguidance's JSON compile options)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice")


class GrammarError(ValueError):
    """A grammar the server refuses: it does not compile, is too large, or took too long to
    compile (HTTP 400, gRPC INVALID_ARGUMENT); ``param``: the request field at fault, where known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to (hashable: the compile cache's key).

    Attributes:
        kind: ``"json_object"`` (any JSON object), ``"json_schema"``, ``"regex"`` or ``"choice"``.
        value: the schema as compact JSON text, its keys in the given order (``json_schema``), the regular expression
            (``regex``, Rust regex syntax, matched in full), the choices as a JSON list of
            strings (``choice``), ``""`` for ``json_object``.
        strict: for ``json_schema``: True refuses a schema with keywords the grammar cannot
            enforce (``uniqueItems``, for one); False compiles it without them, so the output
            follows every other keyword (OpenAI's ``strict``: without it, conformance is best effort).

    Raises:
        GrammarError: an unknown kind, or a value of the wrong form.
    """

    kind: str
    value: str = ""
    strict: bool = True  # json_schema: False ignores keywords llguidance cannot enforce (they may not hold)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; one of {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(self.value, str):
            raise GrammarError("a grammar's value must be text")

    @classmethod
    def json_schema(cls, schema: dict | bool | str, strict: bool = True) -> "GrammarSpec":
        """``schema``: the schema, or its JSON text.

        Raises: GrammarError: the text is not JSON, or the schema is not a JSON object (or boolean)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be a JSON object")
        # keys keep their order: the output writes an object's properties in the schema's order
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), bool(strict))

    @classmethod
    def choice(cls, choices: list[str]) -> "GrammarSpec":
        """Raises: GrammarError: no choices, or one that is not a non-empty string."""
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choices must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    @staticmethod
    def at_most_one(named: list[tuple[str, "GrammarSpec | None"]]) -> "GrammarSpec | None":
        """The one constraint a request gives among its fields (``(field, spec or None)`` pairs), or None.

        Raises:
            GrammarError: more than one is given (``param``: the second).
        """
        given = [(name, spec) for name, spec in named if spec is not None]
        if len(given) > 1:
            raise GrammarError(f"give at most one of {', '.join(n for n, _ in given)}", param=given[1][0])
        return given[0][1] if given else None

    @property
    def size(self) -> int:
        """The spec's length in characters (the compiler refuses specs over its limit)."""
        return len(self.value)

    def grammar(self) -> str:
        """The llguidance grammar (its JSON grammar text).

        Raises:
            GrammarError: the schema is not valid JSON or llguidance refuses it.
        """
        from llguidance import LLMatcher

        try:
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if self.kind == "json_schema":
                options = JSON_OPTIONS | {"lenient": not self.strict}
                return LLMatcher.grammar_from_json_schema(self.value, defaults=options)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.value)
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.value))
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the {self.kind.replace('_', ' ')} does not compile: {e}") from None


class Grammar:
    """A compiled grammar: :meth:`start` gives each sequence its own state.

    Args:
        spec: what was compiled; matcher: an llguidance ``LLMatcher`` in its initial state
            (copied per sequence, never advanced itself); vocab_size: the target's vocabulary V.
    """

    def __init__(self, spec: GrammarSpec, matcher, vocab_size: int, compile_ms: float) -> None:
        self.spec, self._matcher, self.vocab_size, self.compile_ms = spec, matcher, vocab_size, compile_ms

    def start(self) -> "GrammarState":
        return GrammarState(self._matcher.deep_copy(), self.vocab_size)


class GrammarState:
    """One sequence's position in its grammar (an llguidance ``LLMatcher``).

    Attributes:
        masks, mask_ms: token masks computed so far and the milliseconds they took (the cost per
            verified node that BENCHMARKS.md reports).
    """

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m, self.vocab_size = matcher, vocab_size
        self.masks, self.mask_ms = 0, 0.0
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    @property
    def stopped(self) -> bool:
        """The grammar is done (its EOS was consumed, or nothing can follow); only EOS is allowed."""
        return self._m.is_stopped()

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (EOS alone once :attr:`stopped`)."""
        t0 = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
        self.masks += 1
        self.mask_ms += 1e3 * (time.perf_counter() - t0)
        return torch.from_numpy(allowed)

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] logits (any device) → a copy with the tokens the grammar forbids at -inf."""
        return logits.masked_fill(~self.allowed().to(logits.device), float("-inf"))

    def consume(self, token: int) -> None:
        """Advances over one token.

        Raises:
            RuntimeError: the grammar forbids the token (a bug: only masked choices are consumed).
        """
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}: {self._m.get_error()}")

    def valid_prefix(self, tokens) -> int:
        """How many of ``tokens`` the grammar accepts in a row from here (nothing is consumed)."""
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (none where it allows a choice)."""
        return [int(t) for t in self._m.compute_ff_tokens()[:limit]] if limit > 0 else []

    def draft_tree(self, tree: DraftTree, max_forced: int) -> DraftTree:
        """Grammar-aware drafting: ``tree`` without the nodes whose path the grammar forbids, with
        the tokens it forces after the root and after the most probable kept path (up to
        ``max_forced`` each) added as chains of acceptance estimate 1.  Lossless whatever it
        returns (verification masks by the grammar); the root stays node 0.

        Args:
            tree: a draft tree rooted at the sequence's last token, which this state has consumed.
        """
        keep = np.zeros(tree.num_nodes, dtype=bool)
        keep[0] = True
        for path in tree.retrieve_indices:
            path = path[path >= 0]
            ok = self.valid_prefix(tree.tokens[path[1:]])
            keep[path[: ok + 1]] = True
        tree = tree.select(keep)
        tokens, parents, probs = tree.tokens.tolist(), tree.parents.tolist(), tree.probs.astype(np.float64).tolist()
        scores = tree.scores.tolist()
        kids: dict[int, dict[int, int]] = {}
        for i in range(1, len(tokens)):
            kids.setdefault(parents[i], {})[tokens[i]] = i
        changed = False  # a node added, or an estimate raised to 1

        def graft(at: int, chain: list[int]) -> None:
            nonlocal changed
            for tok in chain:
                nxt = kids.setdefault(at, {}).get(tok)
                if nxt is None:
                    nxt = len(tokens)
                    tokens.append(tok), parents.append(at), probs.append(0.0), scores.append(0.0)
                    kids[at][tok] = nxt
                if probs[nxt] != 1.0:
                    probs[nxt], changed = 1.0, True
                at = nxt

        graft(0, self.forced(max_forced))
        # the most probable kept path (path product of the estimates), extended by what it forces
        cum = [1.0] * len(tokens)
        for i in range(1, len(tokens)):
            cum[i] = cum[parents[i]] * probs[i]
        leaf = max((i for i in range(1, len(tokens)) if i not in kids), key=cum.__getitem__, default=None)
        if leaf is not None:
            path, j = [], leaf
            while j > 0:
                path.append(tokens[j])
                j = parents[j]
            fork = GrammarState(self._m.deep_copy(), self.vocab_size)
            if fork.valid_prefix(path[::-1]) == len(path):
                fork._m.consume_tokens(path[::-1])
                graft(leaf, fork.forced(max_forced))
        return _rebuild(tokens, parents, probs, scores) if changed else tree


class MinTokens:
    """vLLM's ``min_tokens``: the sequence's stop tokens (EOS, ``stop_token_ids``) are masked until it
    has ``min_tokens`` tokens, around an optional grammar state (the same interface as
    :class:`GrammarState`, so verification stays lossless: :func:`~dart_core.step.verify.accept_constrained`).
    Where the grammar allows nothing but a stop token, the grammar wins.

    Args:
        inner: a :class:`GrammarState` or None; stop_ids: the stop token ids; min_tokens: ≥ 1.
    """

    def __init__(self, inner: GrammarState | None, stop_ids, min_tokens: int) -> None:
        self.inner, self.min_tokens, self.produced = inner, min_tokens, 0
        self.stop_ids = torch.tensor(sorted(set(int(t) for t in stop_ids)), dtype=torch.long)

    @property
    def stopped(self) -> bool:
        return self.inner is not None and self.inner.stopped

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        logits = self.inner.mask_logits(logits) if self.inner is not None else logits
        if self.produced >= self.min_tokens:
            return logits
        masked = logits.index_fill(-1, self.stop_ids.to(logits.device), float("-inf"))
        return logits if bool(torch.isneginf(masked).all()) else masked

    def consume(self, token: int) -> None:
        if self.inner is not None:
            self.inner.consume(token)
        self.produced += 1

    def draft_tree(self, tree: DraftTree, max_forced: int) -> DraftTree:
        return self.inner.draft_tree(tree, max_forced) if self.inner is not None else tree


def row_constraint(sampling) -> "GrammarState | MinTokens | None":
    """What masks a new sequence's logits, from its :class:`~dart_core.step.sampling.SamplingParams`: its
    grammar's state, wrapped in :class:`MinTokens` when ``min_tokens`` holds back stop tokens;
    None for an unconstrained sequence."""
    inner = sampling.grammar.start() if sampling.grammar is not None else None
    stops = () if sampling.ignore_eos else sampling.stop_token_ids
    if sampling.min_tokens > 0 and stops:
        return MinTokens(inner, stops, sampling.min_tokens)
    return inner


def _rebuild(tokens: list[int], parents: list[int], probs: list[float], scores: list[float]) -> DraftTree:
    """A :class:`DraftTree` from nodes whose parents precede them, reordered by depth."""
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
    order = sorted(range(len(tokens)), key=lambda i: (depth[i], i))
    new_of = {old: new for new, old in enumerate(order)}
    return DraftTree.from_parents([tokens[i] for i in order], [new_of[parents[i]] if i else -1 for i in order],
                                  [depth[i] for i in order], [scores[i] for i in order], [probs[i] for i in order])


#: text whose tokens :func:`grammar_tokenizer` checks: JSON punctuation, spaces, a newline, a tab,
#: accents and characters of several UTF-8 lengths
_TOKEN_PROBE = '{"name": "Zoë", "id": [1, 2.5e-3], "ok": true}\n\t- naïve café 日本語 😀 ĠÄ'


def _byte_level(part) -> bool:
    """Whether a tokenizer.json pre-tokenizer is (or, in a sequence, holds) ByteLevel."""
    if not isinstance(part, dict):
        return False
    return part.get("type") == "ByteLevel" or any(_byte_level(p) for p in part.get("pretokenizers") or ())


def grammar_tokenizer(tokenizer, vocab_size: int):
    """The llguidance tokenizer of a Hugging Face fast tokenizer, checked to read each token as
    the same bytes that the tokenizer decodes it to.

    llguidance learns a token's bytes from the tokenizer's JSON, mainly from its decoder. A
    byte-level BPE tokenizer (GPT-2's scheme: a ByteLevel pre-tokenizer, so every token is
    spelled in the 256-character byte alphabet) is sometimes saved with a decoder that begins
    with ByteFallback, as transformers 5.17 converts SmolLM2's GGUF file; llguidance then reads
    ``Ġ"`` as the bytes of ``Ġ"`` rather than ``␠"``, and every mask is wrong. For such a
    tokenizer the decoder is set to ByteLevel (the byte alphabet is then the only reading).

    The check tokenizes a probe text: for a byte-level tokenizer every token must read as its
    spelling in GPT-2's byte alphabet; for any other (SentencePiece-style, whose decoder may
    drop the first leading space) the probe must read as the tokenizer decodes it, up to
    leading spaces.

    Args:
        tokenizer: a ``PreTrainedTokenizerFast`` (or transformers 5's ``TokenizersBackend``);
        vocab_size: the target's V (the masks' width).

    Returns:
        an ``llguidance.LLTokenizer``.

    Raises:
        GrammarError: the tokenizer is not a fast one, or llguidance reads the probe text's
            tokens as other bytes than the tokenizer decodes them to.
    """
    import copy

    import llguidance

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError("structured output needs a fast (Rust-backed) Hugging Face tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    byte_level = _byte_level(spec.get("pre_tokenizer"))
    if byte_level and (spec.get("decoder") or {}).get("type") != "ByteLevel":
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        spec["model"]["byte_fallback"] = False
    lltok = llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id)
    ids = tokenizer.encode(_TOKEN_PROBE, add_special_tokens=False)
    if byte_level:  # each token's bytes are its spelling in the byte alphabet
        byte_of = {c: b for b, c in _byte_alphabet().items()}
        for t, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
            want, got = bytes(byte_of.get(c, 0) for c in piece), lltok.decode_bytes([t])
            if got != want:
                break
        else:
            return lltok
    else:  # SentencePiece-style decoders may drop the first token's leading space
        want = tokenizer.decode(ids, clean_up_tokenization_spaces=False).encode("utf-8")
        got = lltok.decode_bytes(ids)
        if got.lstrip(b" ") == want.lstrip(b" "):
            return lltok
    raise GrammarError("structured output is unavailable with this tokenizer: llguidance reads its tokens "
                       f"as other bytes than it decodes them to ({got[:40]!r} for {want[:40]!r})")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that spells it in a byte-level
    BPE vocabulary (printable Latin-1 bytes stand for themselves, the others are shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, shifted = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one tokenizer, with an LRU cache keyed by spec.

    Args:
        tokenizer: the target's (fast) Hugging Face tokenizer; vocab_size: the target's V.
        timeout_s: a compile that takes longer is refused (:class:`GrammarError`); it runs in a
            worker thread without the GIL, so a slow schema never stalls the decoding loop.
        max_spec_chars: longer specs are refused before compiling.
        cache_size: compiled grammars kept.

    Raises:
        ImportError: llguidance (a dependency of dart-serve) is not installed.
        GrammarError: llguidance cannot read this tokenizer's tokens (:func:`grammar_tokenizer`).
    """

    def __init__(self, tokenizer, vocab_size: int, *, timeout_s: float = 10.0, max_spec_chars: int = 65536,
                 cache_size: int = 256) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self._tokenizer = grammar_tokenizer(tokenizer, vocab_size)
        self.vocab_size, self.timeout_s, self.max_spec_chars = vocab_size, timeout_s, max_spec_chars
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of ``spec`` (cached).

        Raises:
            GrammarError: the spec is over ``max_spec_chars``, does not compile (llguidance's
                message), or did not compile within ``timeout_s``.
        """
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        if spec.size > self.max_spec_chars:
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} has {spec.size} characters; "
                               f"this server takes at most {self.max_spec_chars}")
        future = self._pool.submit(self._build, spec)
        try:
            grammar = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} did not compile within "
                               f"{self.timeout_s:g} s") from None
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, spec: GrammarSpec) -> Grammar:
        t0 = time.perf_counter()
        matcher = self._llg.LLMatcher(self._tokenizer, spec.grammar(), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} does not compile: {matcher.get_error()}")
        probe = matcher.deep_copy()
        allowed = GrammarState(probe, self.vocab_size).allowed()
        if self._tokenizer.eos_token < self.vocab_size:
            allowed[self._tokenizer.eos_token] = False
        if not probe.is_accepting() and not allowed.any():
            # llguidance compiles an unsatisfiable schema such as {"$ref": "#"} to a grammar whose first
            # mask holds the EOS token alone: decoding it would answer an empty text as if it matched
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} admits no output: no text matches it")
        return Grammar(spec, matcher, self.vocab_size, 1e3 * (time.perf_counter() - t0))
