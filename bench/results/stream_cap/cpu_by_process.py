"""CPU seconds per process (user + system time from /proc) over the time a command runs:
``python bench/results/stream_cap/cpu_by_process.py <command ...>`` prints the wall time, the total,
the command's own CPU time (it and its children), and the 25 processes that used the most (another
process that ended during the window is not counted)."""
import os, subprocess, sys, time
def snap():
    out = {}
    for p in os.listdir('/proc'):
        if not p.isdigit(): continue
        try:
            st = open(f'/proc/{p}/stat').read()
            cmd = open(f'/proc/{p}/cmdline').read().replace('\0', ' ')[:110]
        except OSError: continue
        f = st[st.rfind(')')+2:].split()
        out[int(p)] = (int(f[11]) + int(f[12]), cmd or st[st.find('(')+1:st.rfind(')')])
    return out
hz = os.sysconf('SC_CLK_TCK')
import resource
a = snap(); t0 = time.time()
rc = subprocess.call(sys.argv[1:])
b = snap(); wall = time.time() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"the command itself (and its children): {ru.ru_utime + ru.ru_stime:.2f}s "
      f"{100 * (ru.ru_utime + ru.ru_stime) / wall:.1f}%")
rows = sorted(((b[p][0] - a.get(p, (0,))[0]) / hz, p, b[p][1]) for p in b)
rows = [r for r in rows if r[0] > 0.05][::-1]
print(f"wall {wall:.1f}s, total cpu {sum(r[0] for r in rows):.1f}s")
for s, p, c in rows[:25]: print(f"{s:7.2f}s {100*s/wall:5.1f}% {p:7d} {c}")
