"""CPU time and context switches per process or per thread, read from /proc over a window.

    python cpu.py processes 30          # every process's share of one core over 30 s
    python cpu.py threads PID 10        # the threads of PID
    python cpu.py switches 10           # context switches per second, per process

Linux only; the study's README says when each window ran (idle server, one client, eight).
"""

import collections
import os
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> tuple[str, list[str]]:
    text = open(path).read()
    return text[text.find("(") + 1:text.rfind(")")], text[text.rfind(")") + 2:].split()


def _cmdline(pid: str) -> str:
    raw = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    return raw[:90]


def process_ticks() -> dict:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            name, f = _stat_fields(f"/proc/{pid}/stat")
            out[pid] = (int(f[11]) + int(f[12]), _cmdline(pid) or name)
        except OSError:
            continue
    return out


def thread_ticks(pid: str) -> dict:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, f = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            out[tid] = (int(f[11]) + int(f[12]), name)
        except OSError:
            continue
    return out


def switches() -> dict:
    out = collections.Counter()
    names = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            names[pid] = _cmdline(pid) or pid
            for tid in os.listdir(f"/proc/{pid}/task"):
                for line in open(f"/proc/{pid}/task/{tid}/status"):
                    if "ctxt_switches" in line:
                        out[pid] += int(line.split()[1])
        except OSError:
            continue
    return {pid: (n, names[pid]) for pid, n in out.items()}


def share(before: dict, after: dict, seconds: float, scale: float) -> list[tuple[float, str, str]]:
    rows = [((v - before.get(k, (v,))[0]) * scale / seconds, k, label) for k, (v, label) in after.items()]
    return sorted((r for r in rows if r[0] > 0), reverse=True)


def main(argv: list[str]) -> None:
    kind = argv[0]
    if kind == "threads":
        take, seconds, scale, unit = (lambda: thread_ticks(argv[1])), float(argv[2]), 100 / HZ, "% of one core"
    elif kind == "processes":
        take, seconds, scale, unit = process_ticks, float(argv[1]), 100 / HZ, "% of one core"
    elif kind == "switches":
        take, seconds, scale, unit = switches, float(argv[1]), 1.0, "switches/s"
    else:
        raise SystemExit(__doc__)
    before = take()
    t0 = time.perf_counter()
    time.sleep(seconds)
    rows = share(before, take(), time.perf_counter() - t0, scale)
    for value, key, label in rows[:16]:
        print(f"{value:8.1f}  {key:>7}  {label}")
    print(f"total {sum(r[0] for r in rows):.1f} {unit} over {seconds:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
