"""``python -m dart_core.train --out FOLDER [options]``: self-distilled data →
teacher features → draft head, all cached under ``--work-dir`` and resumable.

The shipped SmolLM2 head is reproduced by the command in its model card
(``dart_core/heads/SmolLM2-135M-Instruct/README.md``)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import logging
import sys
import textwrap
import tokenize

from dart_core.train.data import DataConfig
from dart_core.train.trainer import TrainConfig, train


_SHOWN_DEFAULTS = {"work_dir": "$DART_SERVE_CACHE/train, default ~/.cache/dart-serve/train"}


def field_comments(cls) -> dict[str, str]:
    """The comment written after each field of a dataclass, continuation comment lines joined:
    the configs document their fields there, and ``--help`` shows it.  Fields without one are absent."""
    source = textwrap.dedent(inspect.getsource(cls))
    node = ast.parse(source).body[0]
    field_at = {n.lineno: n.target.id for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    comments: dict[str, list[str]] = {}
    last_name, last_row = None, -1
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row, text = tok.start[0], tok.string.lstrip("#").strip()
        if row in field_at:
            last_name, last_row = field_at[row], row
            comments[last_name] = [text]
        elif last_name and row == last_row + 1 and tok.line.lstrip().startswith("#"):
            comments[last_name].append(text)  # a comment-only line right under a field's comment continues it
            last_row = row
        else:
            last_name = None
    return {name: " ".join(parts) for name, parts in comments.items()}


def _add_fields(ap: argparse.ArgumentParser, cls, skip=()) -> None:
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        text = comments.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        if str(f.type) == "bool":
            ap.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=default,
                            help=f"{text} [{default}]".lstrip())
            continue
        kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" ")[0].replace("None", "").strip("| "),
                                                            str)
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default,
                        required=f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                        help=f"{text} [{_SHOWN_DEFAULTS.get(f.name, default)}]".lstrip())


def add_train_arguments(ap: argparse.ArgumentParser, skip=()) -> None:
    """Adds one option per :class:`TrainConfig` and :class:`DataConfig` field (``--num-prompts`` ...)."""
    _add_fields(ap, TrainConfig, skip=("data", *skip))
    _add_fields(ap, DataConfig, skip=skip)


def config_from_args(args: dict) -> TrainConfig:
    """The :class:`TrainConfig` of parsed options (``vars(namespace)``; the fields are popped from it)."""
    data = DataConfig(**{f.name: args.pop(f.name) for f in dataclasses.fields(DataConfig)})
    return TrainConfig(data=data, **{f.name: args.pop(f.name) for f in dataclasses.fields(TrainConfig)
                                     if f.name != "data" and f.name in args})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.train", description=__doc__.split("\n\n")[0])
    add_train_arguments(ap)
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    args = vars(ap.parse_args(argv))
    quiet = args.pop("quiet")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    summary = train(config_from_args(args), progress=not quiet)
    print(json.dumps({k: summary[k] for k in ("sequences", "steps", "wall_time_s")} | {"eval": summary["eval"][-1:]},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
