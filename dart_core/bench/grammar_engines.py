"""Grammar engines for structured output, measured on this machine:
``python -m dart_core.bench.grammar_engines``.

For each installed engine (xgrammar, llguidance, outlines-core) and each schema of a JSON-schema
set (default ``bench/schemas/json_schemas.jsonl``: 20 hand-written schemas, each with a valid
example instance), with the target's tokenizer (default: the embedded SmolLM2-135M-Instruct):

- **compile ms**: schema to a token-level matcher, with the engine's caches off (median of
  ``--repeats``);
- **mask µs per node**: the allowed-token mask at every position of the example instance's
  tokens, the matcher advanced by each token in turn: what constrained verification pays per
  verified tree node;
- **fork µs**: a copy of a matcher's state after the first half of the instance: what a draft
  tree pays per branching node (an engine without a copy walks back with rollback instead);
- whether every example token was accepted (the engine agrees that the instance fits);
- what the engine offers for tree verification: fork / copy, rollback, forced tokens.

Writes ``grammar_engines.json`` and ``grammar_engines.md`` under ``--out``; ``--page BENCHMARKS.md``
also puts the table into that page's "Grammar engines" block.  No engine is
required: a missing one is reported as missing.  Engines are used through their public Python
APIs only; no JSON-schema-to-grammar code of our own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

__all__ = ["ENGINES", "measure_engines", "markdown_table", "render_section", "main", "START", "END"]

START = "<!-- grammar-engines:start -->"
END = "<!-- grammar-engines:end -->"
HEADING = "## Grammar engines for structured output\n\n"

ENGINES = ("xgrammar", "llguidance", "outlines-core")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_SCHEMAS = REPO / "bench" / "schemas" / "json_schemas.jsonl"


def _ms(t0: float) -> float:
    return 1e3 * (time.perf_counter() - t0)


class _Xgrammar:
    """xgrammar: GrammarCompiler.compile_json_schema, GrammarMatcher (fork, rollback, jump-forward)."""

    offers = {"fork": "fork()", "rollback": "rollback(n)", "forced": "find_jump_forward_string()"}

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.bitmask = xgr.allocate_token_bitmask(1, self.info.vocab_size)

    def compile(self, schema: str):
        return self.xgr.GrammarCompiler(self.info, cache_enabled=False).compile_json_schema(schema)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m) -> None:
        m.fill_next_token_bitmask(self.bitmask)

    def advance(self, m, token: int) -> bool:
        return bool(m.accept_token(token))

    def fork(self, m):
        return m.fork()


class _Llguidance:
    """llguidance: LLMatcher over grammar_from_json_schema (deep_copy, rollback, forced tokens)."""

    offers = {"fork": "deep_copy()", "rollback": "rollback(n)", "forced": "compute_ff_tokens()"}

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import numpy as np

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.bitmask = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)

    def compile(self, schema: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.tok, grammar)  # the grammar is compiled when the matcher is made
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar)

    def mask(self, m) -> None:
        m.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)

    def advance(self, m, token: int) -> bool:
        return bool(m.consume_token(token))

    def fork(self, m):
        return m.deep_copy()


class _OutlinesCore:
    """outlines-core: a regex from the schema, an Index over the vocabulary, a Guide (rollback_state;
    no copy of a guide's state)."""

    offers = {"fork": "–", "rollback": "rollback_state(n)", "forced": "–"}

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import numpy as np
        import outlines_core
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.oc = outlines_core
        decode = {c: b for b, c in bytes_to_unicode().items()}  # byte-level BPE symbols to bytes
        tokens: dict[bytes, list[int]] = {}
        eos = tokenizer.eos_token_id
        for text, i in tokenizer.get_vocab().items():
            if i == eos or i >= vocab_size or text in tokenizer.all_special_tokens:
                continue
            try:
                raw = bytes(decode[c] for c in text)
            except KeyError:  # not a byte-level symbol sequence (an added token): left out
                continue
            tokens.setdefault(raw, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, tokens)
        self.mask_buf = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)

    def compile(self, schema: str):
        return self.oc.Index(self.oc.json_schema.build_regex_from_schema(schema), self.vocab)

    def matcher(self, index):
        return self.oc.Guide(index)

    def mask(self, g) -> None:
        g.write_mask_into(self.mask_buf.ctypes.data, self.mask_buf.size, self.mask_buf.itemsize)

    def advance(self, g, token: int) -> bool:
        try:
            g.advance(token)
            return True
        except Exception:  # noqa: BLE001 - the guide refuses a token it does not allow
            return False

    fork = None


_ADAPTERS = {"xgrammar": _Xgrammar, "llguidance": _Llguidance, "outlines-core": _OutlinesCore}


def _version(engine: str) -> str | None:
    try:
        return metadata.version(engine.replace("-", "_"))
    except metadata.PackageNotFoundError:
        try:
            return metadata.version(engine)
        except metadata.PackageNotFoundError:
            return None


def measure_engines(schemas_path: str | Path = DEFAULT_SCHEMAS, engines: tuple[str, ...] = ENGINES,
                    model: str | None = None, repeats: int = 3) -> dict:
    """{"config", "hardware", "engines": {name: {...}}} (see the module docstring).

    Raises:
        FileNotFoundError: the schema file is missing.
        ValueError: an unknown engine name, or a schema line without ``schema`` / ``example``."""
    from dart_core.bench.decoding import hardware
    from dart_core.model.tokenizer import load_tokenizer

    unknown = [e for e in engines if e not in _ADAPTERS]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}; known: {list(_ADAPTERS)}")
    rows = [json.loads(line) for line in Path(schemas_path).read_text().splitlines() if line.strip()]
    if any("schema" not in r or "example" not in r for r in rows):
        raise ValueError(f"{schemas_path}: every line needs 'schema' and 'example'")
    tokenizer = load_tokenizer(model)
    vocab_size = len(tokenizer)
    started = time.perf_counter()
    out = {}
    for name in engines:
        version = _version(name)
        if version is None:
            out[name] = {"installed": False}
            continue
        t0 = time.perf_counter()
        try:
            eng = _ADAPTERS[name](tokenizer, vocab_size)
        except Exception as e:  # noqa: BLE001 - an engine that cannot take this tokenizer is reported
            out[name] = {"installed": True, "version": version, "error": f"{type(e).__name__}: {e}"}
            continue
        setup_ms = _ms(t0)
        compile_ms, mask_us, fork_us, accepted, errors, rejected = [], [], [], 0, [], []
        for r in rows:
            schema = json.dumps(r["schema"])
            try:
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    compiled = eng.compile(schema)
                    times.append(_ms(t0))
            except Exception as e:  # noqa: BLE001 - a schema the engine refuses is counted, not fatal
                errors.append(f"{r.get('name')}: {type(e).__name__}: {str(e)[:120]}")
                continue
            compile_ms.append(statistics.median(times))
            ids = tokenizer.encode(json.dumps(r["example"]), add_special_tokens=False)
            m = eng.matcher(compiled)
            ok = True
            for j, token in enumerate(ids):
                t0 = time.perf_counter()
                eng.mask(m)
                mask_us.append(1e3 * _ms(t0))
                if eng.fork is not None and j == len(ids) // 2:
                    t0 = time.perf_counter()
                    eng.fork(m)
                    fork_us.append(1e3 * _ms(t0))
                if not eng.advance(m, token):
                    ok = False
                    rejected.append(f"{r.get('name')}: token {j} of {len(ids)} ({tokenizer.decode([token])!r})")
                    break
            accepted += ok
        mask_sorted = sorted(mask_us)
        out[name] = {
            "installed": True, "version": version, "tokenizer_setup_ms": round(setup_ms, 1),
            "schemas": len(rows), "compiled": len(compile_ms), "examples_accepted": accepted,
            "compile_ms_median": round(statistics.median(compile_ms), 2) if compile_ms else None,
            "compile_ms_max": round(max(compile_ms), 2) if compile_ms else None,
            "mask_us_median": round(statistics.median(mask_us), 1) if mask_us else None,
            "mask_us_p90": round(mask_sorted[int(0.9 * (len(mask_sorted) - 1))], 1) if mask_us else None,
            "masks": len(mask_us),
            "fork_us_median": round(statistics.median(fork_us), 1) if fork_us else None,
            "offers": eng.offers, "errors": errors, "examples_rejected": rejected,
        }
    return {"config": {"schemas": str(schemas_path), "engines": list(engines), "model": model, "repeats": repeats,
                       "vocab_size": vocab_size},
            "hardware": hardware("cpu"), "engines": out, "seconds": round(time.perf_counter() - started, 1)}


def markdown_table(result: dict) -> str:
    """One row per engine: versions, compile and mask costs, fork cost, what it offers trees."""
    lines = ["| engine | version | tokenizer setup ms | compile ms (median / max) | mask µs per node (median / p90) "
             "| fork µs | examples accepted | fork / copy | rollback | forced tokens |",
             "|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for name, e in result["engines"].items():
        if not e.get("installed"):
            lines.append(f"| {name} | not installed | | | | | | | | |")
            continue
        if "error" in e:
            lines.append(f"| {name} | {e['version']} | failed: {e['error'][:80]} | | | | | | | |")
            continue
        o = e["offers"]
        fork = "–" if e["fork_us_median"] is None else f"{e['fork_us_median']:.1f}"
        lines.append(f"| {name} | {e['version']} | {e['tokenizer_setup_ms']:.0f} | "
                     f"{e['compile_ms_median']} / {e['compile_ms_max']} | {e['mask_us_median']} / {e['mask_us_p90']} | "
                     f"{fork} | {e['examples_accepted']} of {e['schemas']} | `{o['fork']}` | `{o['rollback']}` | "
                     f"`{o['forced']}` |")
    return "\n".join(lines) + "\n"


def render_section(result: dict, command: str) -> str:
    """The page block (markers included): the machine, the command, the table."""
    from dart_core.bench.decoding import hardware_line

    c = result["config"]
    return "\n".join([START, "", f"_Generated by `{command}`._", "",
                      f"{hardware_line(result['hardware'])}. Tokenizer of {c['model'] or 'SmolLM2-135M-Instruct'} "
                      f"({c['vocab_size']} tokens); {c['schemas'].split('/')[-1]}, compile median of "
                      f"{c['repeats']}; masks and forks along each schema's example instance.", "",
                      markdown_table(result), *_notes(result), END])


def _notes(result: dict) -> list[str]:
    """Schemas an engine refused and example instances it rejected, one bullet each."""
    lines = []
    for name, e in result["engines"].items():
        for msg in e.get("errors", []):
            lines.append(f"- {name} refused {msg}")
        for msg in e.get("examples_rejected", []):
            lines.append(f"- {name} rejected the example of {msg}")
    return ["", *lines, ""] if lines else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.grammar_engines",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", default=str(DEFAULT_SCHEMAS), help="JSONL: name, prompt, schema, example")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--model", default=None, help="model folder or .gguf whose tokenizer is used [embedded default]")
    ap.add_argument("--repeats", type=int, default=3, help="compiles per schema (the median is kept)")
    ap.add_argument("--out", default="bench/results/grammar_engines", help="folder for grammar_engines.json/.md")
    ap.add_argument("--page", default=None, help="also write the table into this page's block (BENCHMARKS.md)")
    args = ap.parse_args(argv)
    try:
        result = measure_engines(args.schemas, tuple(args.engines), args.model, args.repeats)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from dart_core.bench.report import save_table

    save_table(args.out, "grammar_engines", result, markdown_table(result))
    if args.page:
        from dart_core.bench.report import _write_page

        command = "python -m dart_core.bench.grammar_engines " + " ".join(argv if argv is not None else sys.argv[1:])
        _write_page(Path(args.page), render_section(result, command.strip()), START, END, heading=HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
