"""Hosting the tree-search service in Ray (docs/design.md §1).

:func:`start_ngram_service` starts a named, detached, restartable actor that
requests the custom resource ``ngram_host`` (declared only by the
large-memory node(s), e.g. ``ray start --resources='{"ngram_host": 1}'``
or the KubeRay worker group's ``rayStartParams``), so it lands where the
trie's RAM is.  On a host with several NUMA nodes the actor pins itself to
one node's CPUs (``os.sched_setaffinity``; the node is configurable, by
default the one with the most CPUs available to the process) and logs the
choice; the search threads default to that node's CPU count.  It serves on
a fixed port so a restarted actor keeps its address; engines find it with
:func:`resolve_address` (also the resolver of the gRPC client).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray

from ngram_service.server import NgramServer

logger = logging.getLogger(__name__)

__all__ = ["NGRAM_RESOURCE", "ACTOR_NAME", "NAMESPACE", "NgramServiceActor", "start_ngram_service",
           "resolve_address", "numa_nodes", "bind_to_numa_node", "start_pinned_server"]

NGRAM_RESOURCE = "ngram_host"
ACTOR_NAME = "dart-ngram-service"
NAMESPACE = "dart-serve"
DEFAULT_PORT = 50051


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _per_node(sysfs: str | Path, read) -> dict:
    """NUMA node id -> ``read(nodeN folder)`` for every node folder under ``sysfs``; nodes whose
    files are missing or unreadable, or for which ``read`` returns None, are left out."""
    out = {}
    for d in sorted(Path(sysfs).glob("node[0-9]*")):
        try:
            value = read(d)
        except (OSError, ValueError):
            continue
        if value is not None:
            out[int(d.name[4:])] = value
    return out


def numa_nodes(sysfs: str | Path = "/sys/devices/system/node") -> dict[int, list[int]]:
    """NUMA node id -> its CPU ids, from sysfs ({} where sysfs does not say)."""
    return _per_node(sysfs, lambda d: _parse_cpulist((d / "cpulist").read_text()))


def _mem_total(node_dir: Path) -> int | None:
    for line in (node_dir / "meminfo").read_text().splitlines():
        fields = line.split()  # "Node 0 MemTotal: 263847716 kB"
        if len(fields) >= 4 and fields[2] == "MemTotal:":
            return int(fields[3]) * 1024
    return None


def numa_memory(sysfs: str | Path = "/sys/devices/system/node") -> dict[int, int]:
    """NUMA node id -> its memory in bytes (``MemTotal`` of ``nodeN/meminfo``; nodes that do not
    say are left out)."""
    return _per_node(sysfs, _mem_total)


_unpinnable_logged = False


def bind_to_numa_node(node: int | None = None, sysfs: str | Path = "/sys/devices/system/node") -> list[int]:
    """Pins this process to one NUMA node's CPUs when the host has several, so the trie's pages,
    which the kernel places on the node of the CPU that first reads them, and the search threads
    share one node's memory.

    Args:
        node: the node to use; None picks the one with the most memory (the trie lives in the
            page cache), then the most CPUs this process may run on.

    Returns:
        The CPUs the process may use afterwards.  Where the host refuses the pinning (a container
        without that right), a warning is logged once per process and every allowed CPU is kept.

    Raises:
        ValueError: ``node`` does not exist or has none of the allowed CPUs.
    """
    global _unpinnable_logged
    allowed = set(os.sched_getaffinity(0))
    nodes = {n: [c for c in cpus if c in allowed] for n, cpus in numa_nodes(sysfs).items()}
    nodes = {n: cpus for n, cpus in nodes.items() if cpus}
    if node is None and len(nodes) <= 1:
        logger.info("one NUMA node (or none reported): no CPU pinning; %d CPUs", len(allowed))
        return sorted(allowed)
    if node is None:
        memory = numa_memory(sysfs)
        node = max(nodes, key=lambda n: (memory.get(n, 0), len(nodes[n]), -n))
    if node not in nodes:
        raise ValueError(f"NUMA node {node} has none of this process's CPUs (nodes: {sorted(nodes)})")
    try:
        os.sched_setaffinity(0, nodes[node])
    except OSError as e:
        if not _unpinnable_logged:
            logger.warning("could not pin the n-gram service to NUMA node %d (%s): serving on all %d CPUs", node,
                           e, len(allowed))
            _unpinnable_logged = True
        return sorted(allowed)
    logger.info("pinned the n-gram service to NUMA node %d: CPUs %s", node, nodes[node])
    return nodes[node]


def start_pinned_server(trie_path: str | None, *, port: int, threads: int | None = None,
                        numa_node: int | None = None, auth_token: str | None = None, host: str = "0.0.0.0",
                        sysfs: str | Path = "/sys/devices/system/node",
                        learn_max_tokens: int | None = None,
                        learn_snapshot: str | None = None) -> tuple[NgramServer, list[int]]:
    """Binds this process to one NUMA node's CPUs (:func:`bind_to_numa_node`) and starts the
    server on ``host`` (default every interface; the Serve deployment gives the node's own
    address), with as many search threads as that node has CPUs unless ``threads`` is given.
    Used by the Ray actor and by the Serve deployment.  ``learn_max_tokens``: keep a live corpus of
    that many tokens (:class:`~ngram_service.server.NgramServer`), None: none; ``learn_snapshot``:
    its snapshot file.

    Returns:
        the started server and the CPUs the process is bound to.
    """
    cpus = bind_to_numa_node(numa_node, sysfs)
    server = NgramServer(trie_path, host=host, port=port, threads=threads or len(cpus),
                         auth_token=auth_token, learn_max_tokens=learn_max_tokens,
                         learn_snapshot=learn_snapshot).start()
    return server, cpus


@ray.remote(max_restarts=-1, max_task_retries=-1)
class NgramServiceActor:
    """Runs an :class:`NgramServer` inside a Ray actor on the n-gram host."""

    def __init__(self, trie_path: str | None, port: int = DEFAULT_PORT, threads: int | None = None,
                 numa_node: int | None = None, auth_token: str | None = None) -> None:
        logging.basicConfig(level=logging.INFO)
        self.node_ip = ray.util.get_node_ip_address()
        self.server, self.cpus = start_pinned_server(trie_path, port=port, threads=threads, numa_node=numa_node,
                                                     auth_token=auth_token)

    def address(self) -> str:
        return f"{self.node_ip}:{self.server.port}"

    def describe(self) -> dict:
        trie = self.server.trie
        return {"address": self.address(), "cpus": self.cpus, "threads": self.server.threads,
                "trie": None if trie is None else trie.info.path, "pid": os.getpid()}


def start_ngram_service(trie_path: str | None, *, port: int = DEFAULT_PORT, num_cpus: float = 1,
                        threads: int | None = None, numa_node: int | None = None, auth_token: str | None = None,
                        resource: str | None = NGRAM_RESOURCE, name: str = ACTOR_NAME,
                        namespace: str = NAMESPACE, detached: bool = True):
    """Starts (or finds) the named service actor; returns its handle.

    The actor asks for one unit of ``resource`` so only the n-gram host(s)
    can hold it; pass ``resource=None`` on a single machine.
    """
    options = dict(name=name, namespace=namespace, get_if_exists=True, num_cpus=num_cpus, max_restarts=-1,
                   lifetime="detached" if detached else None)
    if resource:
        options["resources"] = {resource: 1}
    return NgramServiceActor.options(**options).remote(trie_path, port, threads, numa_node, auth_token)


def resolve_address(name: str = ACTOR_NAME, namespace: str = NAMESPACE, timeout_s: float = 5.0) -> str:
    """The service's current ``host:port``, asked of the named actor."""
    actor = ray.get_actor(name, namespace=namespace)
    return ray.get(actor.address.remote(), timeout=timeout_s)
