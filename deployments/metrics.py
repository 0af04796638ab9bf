"""Figures a component counts itself (the n-gram service's live corpus, an engine's prefix cache),
exported as Ray Serve metrics and so to Prometheus.  Imports no torch: the ingress imports the
engine deployment's module, which imports this one."""

from __future__ import annotations

from typing import Callable, Mapping

from ray.serve import metrics

__all__ = ["StatsMetrics"]


class StatsMetrics:
    """A component's figures as Ray Serve metrics named ``<prefix>_<figure>``: each of ``gauges``
    set to its figure, each of ``counters`` increased by what its figure rose since the last
    :meth:`update` (the component counts from its own start, the exported counter from the first
    update).

    Args:
        read: the figures by name, as the component reports them now.
        prefix: the metrics' common name prefix.
        gauges, counters: figure name -> the metric's description.
    """

    def __init__(self, read: Callable[[], Mapping[str, float]], prefix: str, gauges: dict[str, str],
                 counters: dict[str, str]) -> None:
        self.read = read
        self.gauges = {name: metrics.Gauge(f"{prefix}_{name}", description=text) for name, text in gauges.items()}
        self.counters = {name: metrics.Counter(f"{prefix}_{name}", description=text)
                         for name, text in counters.items()}
        self._last = dict.fromkeys(self.counters, 0)

    def update(self) -> None:
        """Reads the figures once and hands them to the metrics."""
        figures = self.read()
        for name, gauge in self.gauges.items():
            gauge.set(figures[name])
        for name, counter in self.counters.items():
            now = figures[name]
            if now > self._last[name]:
                counter.inc(now - self._last[name])
            self._last[name] = now
