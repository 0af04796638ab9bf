"""The table of this folder: per pass, each mode's two runs at 1 and 8 clients (tokens/s), their
mean, DART ÷ no speculation, and 1 thread ÷ 2 threads for the pairs run next to each other
(python summarise.py)."""
import json
import statistics
from pathlib import Path

here = Path(__file__).parent
order = ["base-1", "omp1-1", "omp1-2", "base-2", "omp1-3", "base-3"]
pairs = [("omp1-1", "base-1"), ("omp1-2", "base-2"), ("omp1-3", "base-3")]


def runs(name, level, mode):
    rows = json.loads((here / f"{name}-{level}" / "serving.json").read_text())["rows"]
    return next(r for r in rows if r["mode"] == mode)["tokens_per_s_runs"]


mean = {}
print("| pass | threads | 1 client DART | 1 client no spec. | DART ÷ no spec. | 8 clients DART | 8 clients no spec. | DART ÷ no spec. |")
print("|---|---:|---|---|---:|---|---|---:|")
for name in order:
    cells = [name, "1" if name.startswith("omp1") else "2"]
    for level in ("c1", "c8"):
        d, n = runs(name, level, "dart"), runs(name, level, "no-speculation")
        mean[name, level, "dart"], mean[name, level, "nospec"] = statistics.mean(d), statistics.mean(n)
        cells += [", ".join(f"{x:.1f}" for x in d), ", ".join(f"{x:.1f}" for x in n),
                  f"{statistics.mean(d) / statistics.mean(n):.2f}×"]
    print("| " + " | ".join(cells) + " |")
print()
print("| 1 thread ÷ 2 threads | 1 client DART | 1 client no spec. | 8 clients DART | 8 clients no spec. |")
print("|---|---:|---:|---:|---:|")
ratios = {k: [] for k in ("c1dart", "c1nospec", "c8dart", "c8nospec")}
for one, two in pairs:
    cells = [f"{one} ÷ {two}"]
    for level in ("c1", "c8"):
        for mode in ("dart", "nospec"):
            r = mean[one, level, mode] / mean[two, level, mode]
            ratios[level + mode].append(r)
            cells.append(f"{r:.2f}×")
    print("| " + " | ".join(cells) + " |")
print("| median | " + " | ".join(f"{statistics.median(v):.2f}×" for v in ratios.values()) + " |")
