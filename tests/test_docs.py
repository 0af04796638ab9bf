"""The docs stay true: every relative link in README.md, BENCHMARKS.md, docs/ and the study READMEs resolves, every
``python -m …`` command they name exists and answers ``--help``, and the README's headline table is
what ``python -m dart_core.bench.headline`` makes from the result files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
STUDY_PAGES = sorted((REPO / "bench" / "results").glob("*/README.md"))  # links checked; their commands are history
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_COMMAND = re.compile(r"python3? -m ([A-Za-z_][A-Za-z0-9_.]*)")
_NOT_OURS = {"pytest", "pip"}  # third-party tools named in the commands


def _outside_fences(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES + STUDY_PAGES:
        for target in _LINK.findall(_outside_fences(page.read_text())):
            if re.match(r"^(https?:|mailto:|#)", target):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in (REPO / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in readme, page.name


def _commands() -> list[str]:
    found = set()
    for page in PAGES:
        found |= set(_COMMAND.findall(page.read_text()))
    return sorted(m.rstrip(".") for m in found if m.split(".")[0] not in _NOT_OURS)


# runs each named module as ``python -m <module> --help`` would (runpy, argv set), in one interpreter, so
# that torch and transformers are imported once per process instead of once per command
_HELP_DRIVER = """
import contextlib, io, json, runpy, sys
out = {}
for module in sys.argv[1:]:
    buf = io.StringIO()
    sys.argv = [module, "--help"]
    code = 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:
            code = 1
            buf.write(f"{type(e).__name__}: {e}")
    out[module] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def test_every_python_m_command_in_the_docs_answers_help():
    modules = _commands()
    assert "dart_core.bench" in modules and "ngram_service.build" in modules

    def help_of(chunk: list[str]) -> dict[str, list]:
        res = subprocess.run([sys.executable, "-c", _HELP_DRIVER, *chunk], cwd=REPO, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(max_workers=2) as pool:  # two interpreters, the commands dealt out between them
        answers = {m: a for part in pool.map(help_of, [modules[0::2], modules[1::2]]) for m, a in part.items()}
    assert sorted(answers) == modules
    failed = [(m, rc, out[-300:]) for m, (rc, out) in answers.items() if rc != 0 or "usage:" not in out.lower()]
    assert not failed, failed


def test_the_headline_table_is_generated_from_the_result_files(tmp_path):
    from dart_core.bench import headline

    assert headline.main(["--check"]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{headline.START}\n| stale | 9.99× |\n{headline.END}\n\ntail\n")
    assert headline.main(["--check", "--readme", str(readme)]) == 1
    assert headline.write_headline(readme) is True
    text = readme.read_text()
    assert "9.99" not in text and text.endswith("tail\n") and headline.render_headline() in text
    with pytest.raises(ValueError, match="no <!-- headline:start -->"):
        (tmp_path / "bare.md").write_text("# x\n")
        headline.write_headline(tmp_path / "bare.md")


def test_a_serving_headline_is_the_median_of_its_runs(tmp_path):
    from dart_core.bench import headline

    def run(spec, plain):
        return {"rows": [{"concurrency": c, "mode": m, "tokens_per_s": t}
                         for c in (1, 16) for m, t in (("dart", spec[c]), ("no-speculation", plain))]}

    for i, (one, sixteen) in enumerate([(150, 90), (200, 100), (120, 130)]):
        (tmp_path / f"s{i}.json").write_text(json.dumps(run({1: one, 16: sixteen}, 100)))
    (tmp_path / "m.json").write_text(json.dumps({"rows": [{
        "label": "served", "kind": "serving", "files": ["s0.json", "s1.json", "s2.json"], "concurrency": [1, 16],
        "machine": "box", "head": "h", "date": "d", "command": "c"}]}))
    assert "| served | 1.50× at 1 client(s), 1.00× at 16 client(s) | box |" in headline.render_headline(tmp_path / "m.json")


def test_a_structured_output_headline_is_the_median_of_its_runs(tmp_path):
    from dart_core.bench import headline

    for i, (dart, ar) in enumerate([(30, 20), (40, 20), (21, 20)]):
        (tmp_path / f"s{i}.json").write_text(json.dumps({"schemas": 20, "modes": {
            "dart": {"tokens_per_s": dart}, "autoregressive": {"tokens_per_s": ar}}}))
    (tmp_path / "m.json").write_text(json.dumps({"rows": [{
        "label": "json", "kind": "structured", "files": ["s0.json", "s1.json", "s2.json"],
        "machine": "box", "head": "h", "date": "d", "command": "c"}]}))
    assert "| json | 1.50× (20 JSON schemas) | box |" in headline.render_headline(tmp_path / "m.json")


def test_the_one_off_sections_of_benchmarks_md_are_rendered_from_their_result_files(tmp_path):
    """The one-off studies' generated blocks (batching on the CPU, reference import, billion-token trie, ...) are what
    ``python -m dart_core.bench.sections`` makes from the files; a stale block is caught and rewritten."""
    from dart_core.bench import sections

    assert sections.main(["--check"]) == 0
    page = tmp_path / "B.md"
    page.write_text("".join(f"## {n}\n\n<!-- {n}:start -->\n| stale | 9.99 |\n<!-- {n}:end -->\n\nafter {n}\n"
                            for n, _ in sections.SECTIONS))
    assert sections.main(["--check", "--page", str(page)]) == 1
    assert sections.write_sections(page) is True and sections.write_sections(page) is False
    text = page.read_text()
    assert "9.99" not in text and "after billion-trie" in text
    assert sections.render_billion_trie() in text and sections.render_reference_import() in text
    (tmp_path / "bare.md").write_text("# x\n")
    assert sections.main(["--page", str(tmp_path / "bare.md")]) == 2


def test_benchmarks_md_is_generated_short_and_indexes_every_study(tmp_path):
    """BENCHMARKS.md and every study README's header are what ``python -m dart_core.bench.page`` makes
    from the result files and bench/results/studies.json; the page stays short; every study folder is
    listed; a stale page or header is caught, a manifest entry without its answer refused."""
    import shutil

    from dart_core.bench import page

    assert page.main(["--check"]) == 0
    text = (REPO / "BENCHMARKS.md").read_text()
    assert text.count("\n") <= page.MAX_LINES
    folders = {p.name for p in (REPO / "bench" / "results").iterdir() if p.is_dir() and p.name != "quick"}
    assert folders == {s["folder"] for s in page.load_studies()}
    # a copy of the results folder: a changed answer makes both the page and that study's header stale
    results = tmp_path / "results"
    shutil.copytree(REPO / "bench" / "results", results)
    out = tmp_path / "B.md"
    assert page.write_all(results, out) == [out] and not page.write_all(results, out, check=True)
    manifest = json.loads((results / "studies.json").read_text())
    manifest["studies"][1]["answer"] = "a different answer"
    (results / "studies.json").write_text(json.dumps(manifest))
    stale = page.write_all(results, out, check=True)
    assert set(stale) == {out, results / manifest["studies"][1]["folder"] / "README.md"}
    assert "a different answer" not in out.read_text()
    del manifest["studies"][1]["answer"]
    (results / "studies.json").write_text(json.dumps(manifest))
    assert page.main(["--check", "--results", str(results), "--page", str(out)]) == 2
