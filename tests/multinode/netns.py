"""Two Ray nodes on one machine, each in its own Linux network namespace.

Layout (every address lives on links this module creates, and all of it goes when
:meth:`TwoNodes.close` runs, even after a failure):

- namespace A (the head): ``10.231.0.1`` towards B, ``10.231.1.1`` towards the
  test process; it advertises ``num_gpus: 1`` as a scheduling label (no CUDA
  behind it) and runs the Serve controller, the proxies' ingress and the engine;
- namespace B: ``10.231.0.2`` only, with its own loopback; it advertises the
  ``ngram_host`` resource and alone holds the trie file (its ``DART_SERVE_CACHE``);
- the test process (the root namespace) reaches A at ``10.231.1.1`` only.

The Ray processes of a node are exactly the processes of its namespace, so
killing a node is killing ``ip netns pids`` of it.  Token authentication is on,
with a token made here, as a production cluster should run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAD_IP, NGRAM_IP, TEST_SIDE_IP, HEAD_TEST_IP = "10.231.0.1", "10.231.0.2", "10.231.1.254", "10.231.1.1"
GCS_PORT = 6379


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"dartprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _kill_namespace(ns: str) -> int:
    """SIGKILLs every process of namespace ``ns``; returns how many signals went out."""
    killed = 0
    for _ in range(5):  # a dying raylet's children may still be starting
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    return killed


def _remove_leftovers() -> None:
    """Namespaces and links of an earlier run whose test process died before cleaning up (their
    names carry its pid): the addresses are the same in every run, so they must go first."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for ns, pid in re.findall(r"^(dart-[ab]-(\d+))", listed, re.M):
        if not _pid_alive(int(pid)):
            _kill_namespace(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for link, pid in re.findall(r"^\d+: (dtest(\d+))@", links, re.M):
        if not _pid_alive(int(pid)):
            subprocess.run(["ip", "link", "del", link], capture_output=True)


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class TwoNodes:
    """Namespaces, links and Ray nodes A and B; see the module docstring.

    Args:
        cache_a, cache_b: ``DART_SERVE_CACHE`` of each node's processes.
    """

    def __init__(self, cache_a: Path, cache_b: Path) -> None:
        tag = str(os.getpid())  # the leftover sweep of a later run checks whether this process lives
        self.ns_a, self.ns_b = f"dart-a-{tag}", f"dart-b-{tag}"
        self._veth_test = f"dtest{tag}"
        self.temp_dir = Path(tempfile.mkdtemp(prefix="dray", dir="/tmp"))  # short: Ray's socket paths
        self.token = secrets.token_hex(32)
        self.cache = {"a": cache_a, "b": cache_b}
        self._made: list[str] = []
        _remove_leftovers()
        try:
            self._make_links()
        except BaseException:
            self.close()
            raise

    # -- network ------------------------------------------------------------------------------
    def _make_links(self) -> None:
        a, b, t = self.ns_a, self.ns_b, self._veth_test
        for ns in (a, b):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", t, "type", "veth", "peer", "name", f"{t}a", "netns", a)
        _run("ip", "addr", "add", f"{TEST_SIDE_IP}/24", "dev", t)
        _run("ip", "link", "set", t, "up")
        _run("ip", "-n", a, "addr", "add", f"{HEAD_TEST_IP}/24", "dev", f"{t}a")
        _run("ip", "-n", a, "link", "set", f"{t}a", "up")
        _run("ip", "link", "add", "dab", "netns", a, "type", "veth", "peer", "name", "dba", "netns", b)
        _run("ip", "-n", a, "addr", "add", f"{HEAD_IP}/24", "dev", "dab")
        _run("ip", "-n", b, "addr", "add", f"{NGRAM_IP}/24", "dev", "dba")
        _run("ip", "-n", a, "link", "set", "dab", "up")
        _run("ip", "-n", b, "link", "set", "dba", "up")

    # -- processes ----------------------------------------------------------------------------
    def env(self, node: str | None = None) -> dict[str, str]:
        """Environment of a process of ``node`` ("a", "b"; None: a client in the test process)."""
        env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0",
                   # a loaded 2-core machine can take longer than Serve's 5 s to start a proxy
                   RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S="60")
        if node is not None:
            env["DART_SERVE_CACHE"] = str(self.cache[node])
        return env

    def _ns(self, node: str) -> str:
        return self.ns_a if node == "a" else self.ns_b

    def in_ns(self, node: str, *cmd: str, **kwargs) -> subprocess.Popen:
        """Starts ``cmd`` inside node ``node``'s namespace with that node's environment."""
        return subprocess.Popen(["ip", "netns", "exec", self._ns(node), *cmd], env=self.env(node), **kwargs)

    def _ray_start(self, node: str, *args: str) -> None:
        p = self.in_ns(node, sys.executable, "-m", "ray.scripts.scripts", "start", "--disable-usage-stats",
                       "--object-store-memory", str(200 << 20), *args,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = p.communicate(timeout=180)
        if p.returncode != 0:
            raise RuntimeError(f"ray start on node {node} failed:\n{out[-3000:]}")

    def start_head(self, num_cpus: int = 6) -> None:
        self._ray_start("a", "--head", "--node-ip-address", HEAD_IP, "--port", str(GCS_PORT),
                        "--num-cpus", str(num_cpus), "--num-gpus", "1", "--dashboard-host", "0.0.0.0",
                        "--temp-dir", str(self.temp_dir))

    def start_ngram_node(self, num_cpus: int = 1) -> None:
        # one CPU: the n-gram replica fills it, so nothing else of the app lands on B
        self._ray_start("b", "--address", f"{HEAD_IP}:{GCS_PORT}", "--node-ip-address", NGRAM_IP,
                        "--num-cpus", str(num_cpus), "--resources", json.dumps({"ngram_host": 1}))

    def kill_node(self, node: str) -> int:
        """SIGKILLs every process of ``node`` (its raylet, agents and workers); returns how many."""
        return _kill_namespace(self._ns(node))

    def close(self) -> None:
        for ns in reversed(self._made):  # B first
            _kill_namespace(ns)
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its veth ends along
        subprocess.run(["ip", "link", "del", self._veth_test], capture_output=True)
        self._made.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
