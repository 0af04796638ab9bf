"""``python -m dart_core.bench``: the decoding benchmark (see :mod:`dart_core.bench.decoding`)."""

from __future__ import annotations

import argparse
import sys

from dart_core.bench import add_cuda_graphs_argument, add_weights_argument, run_cli
from dart_core.bench.decoding import METHODS, DecodingConfig, markdown_table, run_decoding, save


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dart_core.bench",
        description="Decoding benchmark: autoregressive, Hugging Face generate and prompt lookup, and DART "
                    "(without the n-gram term, with the trie in process, with the request's own context too, "
                    "through the gRPC service) on the same prompts in one run.")
    d = DecodingConfig()
    ap.add_argument("--model", default=d.model, help="model folder or .gguf [embedded SmolLM2-135M-Instruct]")
    ap.add_argument("--head", default=d.head, help="draft head folder [the head shipped for the model]")
    ap.add_argument("--trie", default=d.trie, help='trie file, or "auto" (the default trie, built when missing)')
    ap.add_argument("--datasets", nargs="+", default=d.datasets,
                    help="mt-bench, humaneval, alpacaeval, mt-bench-2 (second turns after the target's own first "
                         "answer), or JSONL files of {'prompt'} / MT-Bench {'turns'}")
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts, help="first N prompts of each dataset")
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--temperature", type=float, default=d.temperature, help="0 (greedy, lossless check) or e.g. 1")
    ap.add_argument("--repeats", type=int, default=d.repeats, help="timed passes (medians over them)")
    ap.add_argument("--methods", nargs="+", default=d.methods, choices=METHODS)
    ap.add_argument("--budget", default=d.budget, help='"auto" (adaptive, as served) or a fixed draft-node count')
    ap.add_argument("--prompt-lookup-num-tokens", type=int, default=d.prompt_lookup_num_tokens)
    ap.add_argument("--context-weight", type=float, default=d.context_weight,
                    help="κ of dart-context and dart-grpc [the engine's default]")
    ap.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    add_weights_argument(ap, d)
    ap.add_argument("--device", default=d.device)
    ap.add_argument("--threads", type=int, default=d.threads)
    add_cuda_graphs_argument(ap)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--eagle3-head", default=d.eagle3_head,
                    help="method eagle3: an EAGLE-3 head folder [the one shipped for the model]")
    ap.add_argument("--eagle3-total-tokens", type=int, default=d.eagle3_total_tokens,
                    help="method eagle3: tree nodes, root included (with --budget N: N + 1)")
    ap.add_argument("--eagle3-depth", type=int, default=d.eagle3_depth, help="method eagle3: expansions after level 1")
    ap.add_argument("--eagle3-top-k", type=int, default=d.eagle3_top_k, help="method eagle3: children per node")
    ap.add_argument("--out", default="bench/results", help="folder for decoding.json/.md/.png")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv=None) -> int:
    return run_cli(DecodingConfig, parser().parse_args(argv), run_decoding, save, markdown_table)


if __name__ == "__main__":
    sys.exit(main())
