"""Per-thread CPU seconds over an interval, from /proc (usage: cpu_sample.py SECONDS)."""
import os, sys, time
HZ = os.sysconf("SC_CLK_TCK")
def snap():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            cmd = open(f"/proc/{pid}/cmdline","rb").read().replace(b"\0",b" ").decode()[:90]
            for tid in os.listdir(f"/proc/{pid}/task"):
                st = open(f"/proc/{pid}/task/{tid}/stat").read()
                comm = st[st.index("(")+1:st.rindex(")")]
                f = st[st.rindex(")")+2:].split()
                out[(pid, tid)] = (cmd, comm, (int(f[11])+int(f[12]))/HZ, int(f[36]) if len(f)>36 else -1)
        except Exception: pass
    return out
dur = float(sys.argv[1]); a = snap(); t0=time.time(); time.sleep(dur); b = snap(); dt=time.time()-t0
rows=[]; per_proc={}
for k,(cmd,comm,c,_) in b.items():
    d = c - a.get(k,(0,0,0,0))[2]
    if d>0: rows.append((d,k,cmd,comm)); per_proc[(k[0],cmd)] = per_proc.get((k[0],cmd),0)+d
print(f"interval {dt:.1f}s, total cpu {sum(r[0] for r in rows):.1f}s of {2*dt:.1f}")
print("== processes")
for (pid,cmd),d in sorted(per_proc.items(), key=lambda x:-x[1])[:15]: print(f"{d/dt*100:6.1f}%  {pid:>7} {cmd}")
print("== threads")
for d,k,cmd,comm in sorted(rows, key=lambda r:-r[0])[:25]: print(f"{d/dt*100:6.1f}%  {k[0]:>7}/{k[1]:<7} {comm:<18} {cmd[:50]}")
