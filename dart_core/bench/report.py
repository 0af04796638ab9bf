"""Regenerates the results page in one command: ``python -m dart_core.bench.report --head DIR``.

1. the decoding benchmark (:mod:`dart_core.bench.decoding`) on MT-Bench,
   HumanEval and AlpacaEval;
2. the serving benchmark (:mod:`dart_core.bench.serving`) against a dart-serve
   app: the one at ``--url``, or one this command starts with
   ``serve run`` on ``deployments/dart.yaml`` (with ``--head``) and stops after;
3. the results block of the full run's page (``bench/results/report/README.md``): tables, plots,
   the exact command, the hardware.  Text outside the markers ``<!-- results:start -->`` /
   ``<!-- results:end -->`` is kept;
4. BENCHMARKS.md, regenerated from those results (:mod:`dart_core.bench.page`).

Presets: the default is the published run (tens of minutes on a 2-core CPU machine); ``--quick``
(one prompt per dataset, short generations, one pass) in 5, and writes under
``bench/results/quick`` so that it never overwrites the published figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dart_core.bench import decoding, serving

__all__ = ["main", "launch_app", "render_page"]

START, END = "<!-- results:start -->", "<!-- results:end -->"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Preset:
    num_prompts: int
    max_new_tokens: int
    repeats: int
    concurrency: tuple[int, ...]
    requests_per_client: int
    serve_max_tokens: int
    serve_repeats: int  # passes per serving level, the median reported (serving.run_sweep)


PRESETS = {"full": Preset(4, 128, 2, (1, 4, 8, 16, 64), 2, 64, 3),
           "quick": Preset(1, 32, 1, (1, 4, 16), 1, 16, 1)}


@contextmanager
def launch_app(head: str | None, *, port: int = 8000, timeout_s: float = 900.0,
               log: Path | None = None, args: dict | None = None, config: str | Path | dict | None = None,
               route_prefixes: tuple[str, ...] = ("",)) -> Iterator[str]:
    """``serve run`` of ``config`` (a file, default ``deployments/dart.yaml``, or a loaded config,
    not modified) with the given head (and
    ``args`` overriding the first application's other ``args:``, e.g. ``{"context_weight": 0}``);
    yields the OpenAI base URL (of the first of ``route_prefixes``) once a chat completion succeeds
    under every one of ``route_prefixes`` (the config's applications' ``route_prefix``, "" for
    ``/``; a completion that the live corpus does not learn) and stops the app (and its local Ray)
    on exit.

    Raises:
        RuntimeError: the app did not answer within ``timeout_s`` (the tail of its log is in the message).
    """
    import yaml

    log = log or Path(tempfile.gettempdir()) / "dart-bench-serve.log"
    cfg = (copy.deepcopy(config) if isinstance(config, dict)
           else yaml.safe_load(Path(config or REPO / "deployments" / "dart.yaml").read_text()))
    cfg["http_options"]["port"] = port
    if head:
        cfg["applications"][0]["args"]["head"] = str(Path(head).resolve())
    cfg["applications"][0]["args"].update(args or {})
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    subprocess.run(["ray", "stop", "--force"], capture_output=True)
    with open(log, "w") as logf:
        proc = subprocess.Popen(["serve", "run", f.name], stdout=logf, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            urls = [f"http://127.0.0.1:{port}{prefix.rstrip('/')}/v1" for prefix in route_prefixes]
            for url in urls:
                if not _wait_ready(url, proc, max(0.0, deadline - time.monotonic())):
                    tail = log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"the Serve app at {url} did not come up within {timeout_s:.0f} s; "
                                       f"log {log}:\n{tail}")
            yield urls[0]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)  # serve run shuts the app and its local Ray down
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            subprocess.run(["ray", "stop", "--force"], capture_output=True)
            Path(f.name).unlink(missing_ok=True)


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Polls until a two-token chat completion succeeds; False on timeout or when ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=5) as r:
                model = json.load(r)["data"][0]["id"]
            body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 2, "learn": False}).encode()
            req = urllib.request.Request(f"{url}/chat/completions", body, {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                if r.status == 200:
                    return True
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(2)
    return False


def render_page(dec: dict, srv: dict | None, command: str, out_dir: Path, page: Path) -> str:
    """The generated results block (between the markers) for ``page``."""
    rel = os.path.relpath(out_dir, page.parent)
    lines = [START, "",
             f"_Generated by `{command}` on {time.strftime('%Y-%m-%d')} in "
             f"{dec['seconds'] + (srv['seconds'] if srv else 0):.0f} s._", "",
             f"**Hardware**: {decoding.hardware_line(dec['hardware'])}.", "",
             f"**Target**: {dec['config']['model'] or 'SmolLM2-135M-Instruct (embedded)'}, {dec['dtype']} on "
             f"{dec['device']}; **draft head**: {'`' + dec['config']['head'] + '`' if dec['config']['head'] else 'the shipped one'}; **trie**: "
             f"`{dec['trie'] or 'none'}`.", "",
             "### Decoding (batch 1)", "",
             decoding.markdown_table(dec), "",
             f"![decoding speedup]({rel}/decoding.png)", ""]
    if srv:
        lines += ["### Serving (`serve run deployments/dart.yaml`, concurrency sweep)", "",
                  serving.markdown_table(srv), "",
                  f"![serving sweep]({rel}/serving.png)", ""]
    lines += [f"Raw results: `{rel}/decoding.json`" + (f", `{rel}/serving.json`" if srv else "") + ".", "", END]
    return "\n".join(lines)


def replace_marked(text: str, block: str, start: str, end: str, where: str | Path = "the page") -> str:
    """``text`` with its block from ``start`` to ``end`` (markers included) replaced by ``block``
    (which carries the markers itself), the text around it kept.

    Raises:
        ValueError: ``text`` lacks one of the markers (``where`` names it in the message)."""
    if start not in text or end not in text:
        raise ValueError(f"{where} has no {start} ... {end} block")
    head, rest = text.split(start, 1)
    return head + block + rest.split(end, 1)[1]


def _write_page(page: Path, block: str, start: str = START, end: str = END, heading: str = "") -> None:
    """Puts ``block`` (which begins with ``start`` and ends with ``end``) in place of the page's
    block between those markers (:func:`replace_marked`); a page without them gets the block
    appended (under ``heading`` when given), a missing page is created."""
    text = page.read_text() if page.is_file() else "# Benchmarks\n"
    if start in text and end in text:
        text = replace_marked(text, block, start, end, page)
    else:
        text = text.rstrip() + "\n\n" + heading + block + "\n"
    page.write_text(text)


def _reused(path: Path, flag: str) -> dict | None:
    """The results of an earlier run that ``flag`` reuses, or None after printing why they cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"error: {flag} needs {path} from an earlier run: {e}", file=sys.stderr)
        return None


def save_table(out: str | Path, name: str, result: dict, table: str) -> Path:
    """Writes ``<out>/<name>.json`` (the result) and ``<out>/<name>.md`` (``table``), prints the table;
    returns the folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(table)
    print(table)
    return out


def section_main(argv, prog: str, description: str, write, page: str) -> int:
    """The CLI of a page section rendered from a results folder (``gpu_report``, ``cpu_report``):
    ``FOLDER [--page PAGE]`` (default ``page``: the study's README); ``write(folder, page)`` renders
    it; 2 with a one-line error for a folder without the files it needs."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("folder", help="results folder")
    ap.add_argument("--page", default=page, help=f"the page holding the section [{page}]")
    args = ap.parse_args(argv)
    try:
        print(write(args.folder, args.page))
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default=None, help="draft head folder [the head shipped for the model]")
    ap.add_argument("--model", default=None, help="model folder or .gguf [embedded SmolLM2-135M-Instruct]")
    ap.add_argument("--quick", action="store_true", help="the < 5 minute preset (figures are not for publishing)")
    ap.add_argument("--url", default=None, help="benchmark this running app instead of starting one")
    ap.add_argument("--no-serving", action="store_true", help="decoding benchmark only")
    ap.add_argument("--reuse-decoding", action="store_true",
                    help="take the decoding results from <out>/decoding.json (an earlier run, e.g. one whose "
                         "serving sweep failed) instead of running the decoding benchmark again")
    ap.add_argument("--reuse-serving", action="store_true",
                    help="take the serving sweep from <out>/serving.json (an earlier run) instead of serving again")
    ap.add_argument("--out", default=None, help="results folder [bench/results, or bench/results/quick]")
    ap.add_argument("--page", default=None, help="the full run's page [bench/results/report/README.md, or "
                                                  "<out>/BENCHMARKS.md with --quick]")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    out = Path(args.out or (REPO / "bench" / "results" / ("quick" if args.quick else "")))
    page = Path(args.page or (out / "BENCHMARKS.md" if args.quick else REPO / "bench" / "results" / "report" / "README.md"))
    command = " ".join(["python -m dart_core.bench.report"] + [shlex.quote(a) for a in (argv or sys.argv[1:])])

    dec_cfg = decoding.DecodingConfig(model=args.model, head=args.head, num_prompts=preset.num_prompts,
                                      max_new_tokens=preset.max_new_tokens, repeats=preset.repeats,
                                      device=args.device, dtype=args.dtype)
    if args.reuse_decoding:
        dec = _reused(out / "decoding.json", "--reuse-decoding")
        if dec is None:
            return 2
    else:
        try:
            dec = decoding.run_decoding(dec_cfg)
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        decoding.save(dec, out)
    print(decoding.markdown_table(dec))
    srv = None
    if args.reuse_serving:
        srv = _reused(out / "serving.json", "--reuse-serving")
        if srv is None:
            return 2
    elif not args.no_serving:
        srv_cfg = serving.ServingConfig(concurrency=list(preset.concurrency),
                                        requests_per_client=preset.requests_per_client,
                                        max_tokens=preset.serve_max_tokens, repeats=preset.serve_repeats)
        try:
            if args.url:
                srv_cfg.url = args.url
                srv = serving.run_serving(srv_cfg)
            else:
                with launch_app(args.head) as url:
                    srv_cfg.url = url
                    srv = serving.run_serving(srv_cfg)
        except (ConnectionError, RuntimeError) as e:
            print(f"error: {e}\n(the decoding results are in {out}/; rerun with --no-serving to publish them alone)",
                  file=sys.stderr)
            return 2
        serving.save(srv, out, title=f"Serving sweep on {dec['hardware']['cpu']} ({dec['hardware']['cpu_count']} CPUs)"
                     + (f", {dec['hardware']['gpu']}" if dec["hardware"].get("gpu") else ""))
        print(serving.markdown_table(srv))
    _write_page(page, render_page(dec, srv, command, out, page))
    print(f"wrote {page} and {out}/")
    if not args.quick and args.page is None and args.out is None:  # the published run: BENCHMARKS.md follows it
        from dart_core.bench import page as results_page

        results_page.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
