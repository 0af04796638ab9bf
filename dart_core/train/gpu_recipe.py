"""``python -m dart_core.train.gpu_recipe``: train the draft head on a borrowed GPU machine.

The machine this recipe is written for has torch, transformers, grpcio and pybind11 but no
package registry and none of dart-serve's data packages; each command runs at most 10 minutes,
the GPU time is 30 minutes in all, at most 64 MiB of files travel with a command (the working
tree included, ≈ 23 MB), the machine is given back after 30 s idle, and results come back
through one output folder in files of at most 16 MiB.  So the recipe has four steps:

1. ``pack`` (here, with the packages): the target model's files (SmolLM2's GGUF is 98 MB), the
   ``gguf`` reader transformers needs for it, and the training examples pre-tokenized
   (:func:`~dart_core.train.data.write_examples`, ≈ 2 bytes per token) are cut into parts of at
   most ``--part-mib`` MiB under ``--dest``, each with the same ``manifest.json`` (sizes, SHA-256).
   With ``--generate-there`` the examples include prompts without answers (tokenized ShareGPT
   first turns), which ``train`` answers there.
2. ``stage PART --dir D`` (there, once per part, one command each, carrying that part):
   copies the part into ``D``; once every chunk of a file is there, the file is joined and its
   SHA-256 checked.
3. ``train --dir D --results $OUT`` (there, repeated): :func:`~dart_core.train.trainer.train`
   on the staged model and examples (first answering the packed prompts with the target, greedy,
   ``--generate-batch-size`` 256 sequences at a time, into ``D/work/data``), stopping itself after
   ``--max-minutes`` (default 8.5) with the answers, features or checkpoint so far in ``D/work``;
   the next call continues it.  Each call writes ``status.json``
   to the results folder; the finished head is written there too, its weights cut into chunks
   under 16 MiB.  No τ is measured there (the n-gram trie is not built there).
4. ``unpack FOLDER --out HEAD`` (here): joins and checks the head, loads it once.

``D`` lives only as long as the machine: the commands of steps 2 and 3 must follow each other
within the machine's idle time, and when the machine is gone a new one starts from step 2.
docs/training.md ("Training the draft head on a GPU") gives the command sequence and what fits in 30 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["pack", "stage", "run_training", "unpack", "main", "RecipeError"]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
RESULT_CHUNK = 15 << 20  # bytes per returned chunk: under the 16 MiB a returned file may have
_WEIGHTS = "model.safetensors"


class RecipeError(RuntimeError):
    """A recipe step cannot go on: missing parts, a checksum mismatch, an incomplete stage."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _split(path: Path, chunk: int, dest: Path, stem: str) -> list[str]:
    """Cuts ``path`` into ``dest/stem.000``, ``.001`` ... of at most ``chunk`` bytes; returns their names."""
    names = []
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            if not data and names:
                break
            name = f"{stem}.{len(names):03d}"
            (dest / name).write_bytes(data)
            names.append(name)
            if not data:
                break
    return names


def _join(chunks: list[Path], out: Path, sha256: str) -> None:
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as f:
        for c in chunks:
            with open(c, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
    if _sha256(tmp) != sha256:
        tmp.unlink()
        raise RecipeError(f"{out.name}: SHA-256 mismatch after joining {len(chunks)} chunks (a part is corrupt or "
                          "from another pack)")
    tmp.replace(out)


def _write_dist_info(site: Path, package: str) -> None:
    """A minimal ``<package>-<version>.dist-info`` beside a copied package: transformers asks
    ``importlib.metadata`` for the gguf reader's version, which a bare package folder does not have
    (seen on the first GPU run: "Invalid version: 'N/A'")."""
    from importlib.metadata import version

    v = version(package)
    info = site / f"{package}-{v}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {v}\n")


def pack(dest: str | Path, *, model: str | None, data, work_dir: str | Path | None, part_mib: float = 32.0,
         extra: list[str | Path] = (), generate_there: bool = False, skipped_last: bool = False) -> dict:
    """Writes the parts (step 1).  ``data`` is a :class:`~dart_core.train.data.DataConfig`: the
    self-distilled responses already stored under ``work_dir/data`` (below ``num_prompts``;
    nothing is generated here) plus ``sharegpt_turns`` teacher-forced ShareGPT turns.  With
    ``generate_there``, the prompts below ``num_prompts`` that have no stored answer travel too,
    tokenized through the chat template as prompt-only examples, and ``train`` answers them there
    with the target (the self-distilled source, greedy, at the GPU's batch size) before its teacher
    forwards; the held-out prompts among them are answered too, so the held-out set exists there.
    With ``skipped_last`` (and ``data.prompt_skip``), the unanswered prompts that ``prompt_skip``
    passes over travel as well, after the fresh ones: ``train`` answers in file order, so a time
    limit there leaves the prompts an earlier run already learnt from out first.
    ``extra`` files (a trie, prompt files for the benchmarks there) travel too and are staged as
    ``files/extra/<name>``.

    Returns the manifest.  Raises:
        ValueError: no examples, or a part size under 1 MiB.
        FileNotFoundError: the model cannot be found.
    """
    from dart_core.model.tokenizer import load_tokenizer, resolve_model
    from dart_core.train.data import (is_teacher_forced, later_turn_prompts, stored_examples, unanswered_prompts,
                                      write_examples)
    from ngram_service.cache import cache_root

    if part_mib < 1:
        raise ValueError("--part-mib must be at least 1")
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    source = resolve_model(model)
    folder = Path(source.folder)
    model_files = [folder / source.gguf_file] if source.gguf_file else sorted(p for p in folder.iterdir() if p.is_file())
    tokenizer = load_tokenizer(model)
    work = Path(work_dir).expanduser() if work_dir else cache_root() / "train"
    later = later_turn_prompts(tokenizer, data)  # prompt_skip, replaced below, does not change them
    examples = stored_examples(data, work / "data", tokenizer, later=later)
    asked = []
    if generate_there:
        skipped_too = skipped_last and data.prompt_skip
        asked = unanswered_prompts(dataclasses.replace(data, prompt_skip=0) if skipped_too else data, work / "data",
                                   tokenizer, later=later)
        if skipped_too:  # stable: the held-out and fresh ones first, each part in list order
            asked.sort(key=lambda e: data.eval_prompts <= e.index < data.prompt_skip)
    if not examples and not asked:
        raise ValueError(f"nothing to pack: no responses in {work / 'data'}, no --sharegpt-turns and no prompts "
                         "to answer there (--generate-there)")
    with tempfile.TemporaryDirectory() as tmp:
        payload = [(f"model/{p.name}", p) for p in model_files]
        for path in map(Path, extra):  # before the examples, so the parts a benchmark needs come first
            if not path.is_file():
                raise FileNotFoundError(f"--extra {path}: no such file")
            payload.append((f"extra/{path.name}", path))
        payload.append(("examples.npz", write_examples(examples + asked, Path(tmp) / "examples.npz")))
        site = []
        if source.gguf_file:  # transformers reads GGUF through the gguf package, absent there
            import gguf

            site.append(Path(gguf.__file__).parent)
        chunk = int(part_mib * (1 << 20))
        staging = Path(tmp) / "chunks"
        staging.mkdir()
        files, all_chunks = [], []
        for name, path in payload:
            names = _split(path, chunk, staging, name.replace("/", "__"))
            files.append({"name": name, "bytes": path.stat().st_size, "sha256": _sha256(path), "chunks": names})
            all_chunks += names
        # parts filled in order, each at most `chunk` bytes of chunks (a chunk is never split further)
        parts, size = [[]], 0
        for name in all_chunks:
            n = (staging / name).stat().st_size
            if parts[-1] and size + n > chunk:
                parts.append([])
                size = 0
            parts[-1].append(name)
            size += n
        manifest = {"format": 1, "model": source.name, "model_file": source.gguf_file or None,
                    "files": files, "parts": {f"part-{i + 1}": names for i, names in enumerate(parts)},
                    "eval_prompts": data.eval_prompts,
                    "examples": {"sequences": len(examples), "tokens": sum(len(e.ids) for e in examples),
                                 "sharegpt_turns": sum(1 for e in examples if is_teacher_forced(e.index)),
                                 "prompts_to_answer": len(asked),
                                 "prompt_tokens_to_answer": sum(len(e.prompt_ids) for e in asked)},
                    "site_packages": [p.name for p in site]}
        for i, names in enumerate(parts):
            pdir = dest / f"part-{i + 1}"
            pdir.mkdir()
            for name in names:
                shutil.move(staging / name, pdir / name)
            if i == 0:
                for pkg in site:
                    shutil.copytree(pkg, pdir / "site" / pkg.name, ignore=shutil.ignore_patterns("__pycache__"))
                    _write_dist_info(pdir / "site", pkg.name)
            (pdir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def stage(part: str | Path, directory: str | Path) -> dict:
    """Copies one part into ``directory`` and joins every file whose chunks are all there (step 2).

    Returns ``{"complete": bool, "missing_parts": [...], "files": [...joined...]}``.
    Raises:
        RecipeError: the part has no manifest, or it belongs to another pack than the staged ones.
    """
    part, directory = Path(part), Path(directory)
    if not (part / MANIFEST).is_file():
        raise RecipeError(f"{part} is not a recipe part (no {MANIFEST})")
    manifest = json.loads((part / MANIFEST).read_text())
    directory.mkdir(parents=True, exist_ok=True)
    staged = directory / MANIFEST
    if staged.is_file() and json.loads(staged.read_text()) != manifest:
        raise RecipeError(f"{part} belongs to another pack than the parts staged in {directory}: "
                          "stage every part of one pack (or use another --dir)")
    staged.write_text(json.dumps(manifest, indent=2) + "\n")
    chunks = directory / "chunks"
    chunks.mkdir(exist_ok=True)
    for name in manifest["parts"].get(part.name, []):
        shutil.copyfile(part / name, chunks / name)
    if (part / "site").is_dir():
        shutil.copytree(part / "site", directory / "site", dirs_exist_ok=True)
    joined = []
    for f in manifest["files"]:
        out = directory / "files" / f["name"]
        if out.is_file() and out.stat().st_size == f["bytes"]:
            joined.append(f["name"])
            continue
        paths = [chunks / c for c in f["chunks"]]
        if all(p.is_file() for p in paths):
            out.parent.mkdir(parents=True, exist_ok=True)
            _join(paths, out, f["sha256"])
            for p in paths:
                p.unlink()
            joined.append(f["name"])
    done = set(joined)
    owned = {c: f["name"] for f in manifest["files"] for c in f["chunks"]}
    missing = sorted(pname for pname, names in manifest["parts"].items()
                     if not all(owned[n] in done or (chunks / n).is_file() for n in names))
    return {"complete": len(done) == len(manifest["files"]), "missing_parts": missing, "files": sorted(done)}


def run_training(directory: str | Path, results: str | Path, args: dict, *, progress: bool = True) -> dict:
    """One training call on the staged files (step 3): ``args`` are the train options
    (:func:`dart_core.train.__main__.add_train_arguments` fields).  Returns the status written to
    ``results/status.json``; a finished head is exported to ``results`` in chunks.

    Raises:
        RecipeError: the stage is incomplete.
    """
    directory, results = Path(directory).resolve(), Path(results)
    staged = directory / MANIFEST
    if not staged.is_file():
        raise RecipeError(f"nothing staged in {directory}: run `stage` with every part first")
    manifest = json.loads(staged.read_text())
    absent = [f["name"] for f in manifest["files"] if not (directory / "files" / f["name"]).is_file()]
    if absent:
        raise RecipeError(f"staging incomplete in {directory}: {', '.join(absent)} not joined yet")
    if (directory / "site").is_dir():
        sys.path.insert(0, str(directory / "site"))
    os.environ.setdefault("DART_SERVE_CACHE", str(directory / "cache"))
    from dart_core.train.__main__ import config_from_args
    from dart_core.train.trainer import train

    model = directory / "files" / "model"
    if manifest.get("model_file"):
        model = model / manifest["model_file"]
    args = {**args, "out": str(directory / "head"), "work_dir": str(directory / "work"), "model": str(model),
            "examples_file": str(directory / "files" / "examples.npz"), "eval_prompts": manifest["eval_prompts"]}
    summary = train(config_from_args(args), progress=progress)
    results.mkdir(parents=True, exist_ok=True)
    status = {k: v for k, v in summary.items() if k != "config"}
    (results / "status.json").write_text(json.dumps(status, indent=2) + "\n")
    if summary["finished"]:
        head = directory / "head"
        for name in ("config.json", "training.json"):
            shutil.copyfile(head / name, results / name)
        names = _split(head / _WEIGHTS, RESULT_CHUNK, results, _WEIGHTS)
        (results / "head.json").write_text(json.dumps({"sha256": _sha256(head / _WEIGHTS), "chunks": names}) + "\n")
    return status


def unpack(folder: str | Path, out: str | Path) -> Path:
    """Joins a head returned by ``train`` (step 4) into ``out`` and checks that it loads.

    Raises:
        RecipeError: no finished head in ``folder``, or a checksum mismatch.
        dart_core.spec.draft_head.HeadLoadError: the joined head does not load.
    """
    from dart_core.spec.draft_head import load_draft_head

    folder, out = Path(folder), Path(out)
    if not (folder / "head.json").is_file():
        raise RecipeError(f"no finished head in {folder} (its status.json says how far training got)")
    info = json.loads((folder / "head.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    _join([folder / c for c in info["chunks"]], out / _WEIGHTS, info["sha256"])
    for name in ("config.json", "training.json"):
        shutil.copyfile(folder / name, out / name)
    load_draft_head(out)
    return out


#: The DataConfig fields that ``pack`` takes as options (integers): which examples and prompts travel.
_PACK_DATA_OPTIONS = ("num_prompts", "sharegpt_turns", "sharegpt_skip", "prompt_skip", "later_turns",
                      "later_turns_skip", "eval_prompts", "max_prompt_tokens", "max_new_tokens", "prompt_seed")


def main(argv: list[str] | None = None) -> int:
    from dart_core.train.__main__ import add_train_arguments, field_comments
    from dart_core.train.data import DataConfig

    ap = argparse.ArgumentParser(prog="python -m dart_core.train.gpu_recipe", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    p = sub.add_parser("pack", help="step 1, here: cut model + examples into parts")
    p.add_argument("--dest", default="artifacts/gpu", help="parts folder [artifacts/gpu]")
    p.add_argument("--part-mib", type=float, default=32.0, help="MiB per part [32]")
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--work-dir", default=None, help="where the self-distilled responses are (as for training)")
    p.add_argument("--extra", nargs="*", default=[], metavar="FILE",
                   help="more files to send (a trie, prompt files), staged as files/extra/NAME")
    comments = field_comments(DataConfig)
    for name in _PACK_DATA_OPTIONS:
        default = getattr(DataConfig, name)
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=f"{comments[name]} [{default}]")
    p.add_argument("--exclude-alpacaeval", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--generate-there", action="store_true",
                   help="send the prompts below --num-prompts that have no stored answer, for `train` to answer "
                        "there with the target (self-distilled data generated on the GPU)")
    p.add_argument("--skipped-last", action="store_true",
                   help="with --generate-there and --prompt-skip: send the passed-over prompts too, after the fresh "
                        "ones (answered last there, so a time limit drops them first)")
    s = sub.add_parser("stage", help="step 2, there: copy one part in, join what is complete")
    s.add_argument("part")
    s.add_argument("--dir", required=True)
    t = sub.add_parser("train", help="step 3, there: train (resumable) and export the head")
    t.add_argument("--dir", required=True)
    t.add_argument("--results", required=True, help="the returned folder ($OUT)")
    add_train_arguments(t, skip=("out", "work_dir", "model", "examples_file", "eval_prompts"))
    t.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    t.set_defaults(max_minutes=8.5, eval_tau_prompts=0, generate_batch_size=256)
    u = sub.add_parser("unpack", help="step 4, here: join the returned head")
    u.add_argument("folder")
    u.add_argument("--out", required=True)
    args = vars(ap.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    step = args.pop("step")
    try:
        if step == "pack":
            data = DataConfig(**{k: args[k] for k in (*_PACK_DATA_OPTIONS, "exclude_alpacaeval")})
            m = pack(args["dest"], model=args["model"], data=data, work_dir=args["work_dir"], part_mib=args["part_mib"],
                     extra=args["extra"], generate_there=args["generate_there"],
                     skipped_last=args["skipped_last"])
            print(json.dumps({"parts": {k: len(v) for k, v in m["parts"].items()}, "examples": m["examples"]}))
        elif step == "stage":
            print(json.dumps(stage(args["part"], args["dir"])))
        elif step == "train":
            directory, results, quiet = args.pop("dir"), args.pop("results"), args.pop("quiet")
            status = run_training(directory, results, args, progress=not quiet)
            print(json.dumps({k: status.get(k) for k in ("finished", "stage", "prompts", "steps", "steps_done",
                                                         "wall_time_s")}))
        else:
            print(unpack(args["folder"], args["out"]))
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
