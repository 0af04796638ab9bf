"""Where the served engine's decoding thread (``dart-batcher``) spends its samples, from a
py-spy raw profile taken with native frames:

    py-spy record -p <engine replica pid> -d 10 -r 100 --threads --idle --native -f raw -o prof.txt
    python decode_profile.py prof.txt

Categories: inside a Ray metric call (``Metric._record``, GIL release and retake included),
retaking the GIL after a C++ kernel released it, waiting for a request, and everything else
(the decoding step's own work).
"""

import collections
import sys


def classify(stack: str) -> str:
    if "Metric._record" in stack:
        return "Ray metric calls"
    if "Condition.wait" in stack and "ContinuousBatcher._take" in stack:
        return "waiting for a request"
    if "gil_scoped_release::~" in stack or ("pthread_cond_timedwait" in stack and "GGUFLayers" in stack):
        return "retaking the GIL after a kernel"
    return "the step's own work"


def main(path: str) -> None:
    counts, total = collections.Counter(), 0
    for line in open(path):
        stack, n = line.rstrip().rsplit(" ", 1)
        if "dart-batcher" not in stack.split(";")[0]:
            continue
        total += int(n)
        counts[classify(stack)] += int(n)
    print(f"decoding-thread samples: {total}")
    for name, n in counts.most_common():
        print(f"  {name}: {n} ({100 * n / total:.1f} %)")


if __name__ == "__main__":
    main(sys.argv[1])
