"""Benchmarks (issue 7): decoding (``python -m dart_core.bench``), serving
(``python -m dart_core.bench.serving``) and the results page that both feed
(``python -m dart_core.bench.report``).  See BENCHMARKS.md."""
