"""Tree budget: how many draft nodes each step verifies.

On a GPU a 60-node tree costs about as much to verify as one token; on a CPU
it costs several times more (docs/design.md §2, "Tree budget"), so the budget
that maximises tokens per second depends on the device.  :class:`AdaptiveBudget` picks it per step and
per sequence:

    tokens/s(B) = E[tokens | B] / (t_draft+search + t_verify(B + 1))
    E[tokens | B] = 1 + c · Σ_{B best nodes} P(node accepted)

P(node accepted) is estimated as the product of the draft probabilities on
the node's path (the draft head's own belief, or on a context chain the
chain's evidence q where higher: ``DraftTree.probs``); ``c`` calibrates it online as
the ratio of exponentially decayed sums, accepted nodes ÷ uncalibrated estimates, so that
calibrated predictions match what is accepted on average.  Nodes are taken in
the search's own rank order (min-score along the path, then depth), so every
truncation is prefix-closed.  ``t_verify`` is a :class:`VerifyCostCurve`
measured once at start-up (or configured): at batch 1 on a CPU, at batches
1, 4 and 16 on an accelerator (:func:`curve_shapes`).  A batch verifies in
one forward with every tree padded to the largest, so
:meth:`AdaptiveBudget.select_batch` gives all its trees one node count n and
prices it at ``t_verify(B, n + 1)`` (:meth:`VerifyCostCurve.cost`): the
measured batch sizes interpolated, or with the batch-1 curve alone
``t_verify(B · (n + 1))``, an approximation (the linear layers see all
B · (n + 1) query tokens; attention sees each sequence's own context).

**Lookup steps** (:meth:`AdaptiveBudget.select_lookup`): where the request's
own context proposes a continuation (a :class:`~ngram_service.tree_search.ContextChain`),
a step may verify that chain alone, as prompt-lookup decoding does, and skip
the draft head and the tree search.  Such a step is priced with its own
estimates: a chain token's acceptance, given that the token before it was
accepted, is learnt online per match length m (the suffix tokens that matched)
as r_m = (accepted + 2) / (offered + 3) over exponentially decayed counts,
so a chain of n tokens is expected to yield 1 + Σ_{j ≤ n} r_m^j tokens
for ``t_verify(n + 1)`` plus the measured lookup-step overhead.  The engine
takes a lookup step when that rate, at its best n ≥ 1, reaches
``lookup_preference`` × the tokens/ms that its tree steps have measured at the
same batch size (docs/engine.md, "Context in the tree").
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np
import torch

from dart_core.model.device import sync_device
from dart_core.model.kv_cache import cache_mask
from dart_core.spec.speculative import LOOKUP_PREFERENCE
from dart_core.model.target import TargetCache, TargetModel
from ngram_service.tree_search import ContextChain, DraftTree, SearchParams, TreeBatch

logger = logging.getLogger(__name__)

__all__ = ["VerifyCostCurve", "CalibrationInterrupted", "curve_shapes", "AdaptiveBudget", "SpeculationGate",
           "node_acceptance_estimates", "chain_speedup", "chain_taus", "LOOKUP_PREFERENCE", "CAN_PAY_MARGIN"]


_CHAIN_PRIOR = (2.0, 3.0)  # r_m before evidence: 2/3
_CHAIN_DECAY = 0.95  # weight of older chain evidence per observation
_MATCH_BUCKETS = (32, 16, 9)  # match lengths learnt together from 9 on (a live corpus's long matches)


def _match_bucket(match_length: int) -> int:
    """The key r_m is learnt under: the match length itself up to 8, then 9, 16 and 32 for the
    lengths from each on (a live corpus measures matches past its context length: each length
    alone would be seen too rarely to learn from)."""
    m = int(match_length)
    return next((b for b in _MATCH_BUCKETS if m >= b), m)
_TREE_RATE_EMA = 0.2  # weight of the newest step in the tree rate and the lookup overhead
_FIRST_LEVEL_DECAY = 0.99  # weight of older rows in the first-level acceptance (about 100 sequence-steps)
_FIRST_LEVEL_PRIOR = 8.0  # rows of acceptance 1 before any evidence (can_pay starts where it did: α = 1)
CAN_PAY_MARGIN = 0.2  # can_pay's α: the measured first-level acceptance plus this (deeper levels may accept more)
_OVERHEAD_STALE_STEPS = 1024  # can_pay calls with no speculative step after which the overhead is re-measured
_OVERHEAD_MIN_STEPS = 8  # speculative steps the overhead must have seen before can_pay prices it (0 until then) ...
_GRACE_CEILING = 1.5  # ... at batch sizes whose ceiling with drafting free reaches this at can_pay's acceptance


def chain_taus(alpha, nodes) -> list[float]:
    """τ(n) for each n of ``nodes``: the tokens per sequence of a step that verifies a chain of
    n − 1 draft tokens, the bonus token included, 1 + α_1 + α_1·α_2 + … (n − 1 terms after the 1).

    Args:
        alpha: one acceptance for every level (α_k = α, so τ(n) = 1 + α + … + α^(n−1)), or the
            per-level acceptances α_1, α_2, … of a token whose parent was accepted; past the
            last one, or from a None on, no token is accepted (the chain stops there).
        nodes: query tokens per sequence (n ≥ 1).

    Raises:
        ValueError: an acceptance outside [0, 1]."""
    nodes = [int(n) for n in nodes]
    one = isinstance(alpha, (int, float))
    given = [float(alpha)] if one else [float(a) for a in itertools.takewhile(lambda a: a is not None, alpha)]
    for a in given:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {a}")
    rates = given * max(0, max(nodes, default=1) - 1) if one else given
    cum, prod = [1.0], 1.0
    for a in rates:
        prod *= a
        cum.append(cum[-1] + prod)
    return [cum[min(n, len(cum)) - 1] for n in nodes]


def chain_speedup(ms, nodes, alpha) -> tuple[float, int]:
    """The best speed-up over plain decoding, and its node count, of drafts verified with the
    timings ``ms`` [len(nodes)] (ms of one speculative step whose forward verifies ``nodes[i]``
    query tokens per sequence at one batch size; ``nodes`` must include 1, the plain step).

    Model: each sequence drafts a chain of n − 1 tokens, each accepted with probability ``alpha``
    once its parent is (or with per-level probabilities α_1, α_2, …: :func:`chain_taus`), so a
    step emits τ(n) = 1 + α + … + α^(n−1) tokens per sequence (the bonus token included).
    Speed-up(n) = τ(n) · ms(1) / ms(n); the best over the measured n (the smaller n on a tie).
    With α = 1 and ``ms`` the forward alone this bounds every drafter that verifies n nodes per
    sequence (no tree of n nodes accepts more than n tokens): the most speculation can give at
    that batch size on that hardware.

    Raises:
        ValueError: an acceptance outside [0, 1], or no node count 1."""
    nodes = [int(n) for n in nodes]
    taus = chain_taus(alpha, nodes)
    if 1 not in nodes:
        raise ValueError("the node counts must include 1 (the plain decoding step)")
    plain = float(ms[nodes.index(1)])
    speedup, fewer = max((tau * plain / float(t), -n) for n, t, tau in zip(nodes, ms, taus))
    return speedup, -fewer  # on a tie the fewer nodes (less to draft)


def _decayed_sum(old: float, values: np.ndarray, decay: float) -> float:
    """``old`` and then ``values`` in order, each step multiplying the sum so far by ``decay`` before
    adding the next value: decay^k · old + Σ_i decay^(k−1−i) · values[i] (k = len(values))."""
    k = len(values)
    return float(decay ** k * old + decay ** np.arange(k - 1, -1, -1) @ np.asarray(values, dtype=np.float64))


class StepTimeAverage:
    """Exponential moving average of a per-step time (ms) that a one-off stall cannot carry.

    The first speculative step of an engine pays one-off costs that later steps do not: the
    n-gram service's gRPC channel connecting, the draft head's fused kernels being built, first
    pages touched.  As the first value of a plain average it stayed in the average for dozens of
    steps, and the budget's :meth:`AdaptiveBudget.can_pay` then stopped speculation for good
    (nothing speculative is observed while it says no; served on a 2-core Xeon:
    ``bench/results/xeon_vnni/``).  So:

    - an observation more than ``outlier`` times the average is a stall and is not averaged,
      unless ``confirm`` such observations come in a row: then the level has changed, and the
      average restarts at their median;
    - an observation below the average ÷ ``outlier`` restarts the average there (the earlier
      values were the stall);
    - otherwise ``steps`` observations' weight: ``value ← d·value + (1 − d)·x``, d = (1 − weight)^steps.

    Raises:
        ValueError: ``weight`` outside (0, 1], ``outlier`` ≤ 1 or ``confirm`` < 1.
    """

    def __init__(self, weight: float, outlier: float = 4.0, confirm: int = 3) -> None:
        if not 0 < weight <= 1 or not outlier > 1 or confirm < 1:
            raise ValueError("need 0 < weight <= 1, outlier > 1 and confirm >= 1")
        self.weight, self.outlier, self.confirm = weight, outlier, confirm
        self.value = 0.0  # ms; 0 before the first observation
        self.stalls = 0  # observations left out as stalls
        self.count = 0  # observations since the start or the last reset, stalls included
        self._high: list[float] = []

    def add(self, x: float, steps: int = 1) -> None:
        """Feeds one observation ``x`` (ms), weighing as ``steps`` observations."""
        self.count += 1
        if self.value <= 0:
            self.value = float(x)
            return
        if x > self.outlier * self.value:
            self._high.extend([float(x)] * steps)
            if len(self._high) >= self.confirm:
                self.value, self._high = statistics.median(self._high), []
            else:
                self.stalls += steps
            return
        self._high = []
        if x * self.outlier < self.value:
            self.value = float(x)
            return
        decay = (1.0 - self.weight) ** steps
        self.value = decay * self.value + (1.0 - decay) * float(x)

    def reset(self) -> None:
        """Forgets every observation."""
        self.value, self._high, self.count = 0.0, [], 0


def _ema(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average: ``new`` when there is no ``old`` value yet, else (1 - weight)·old + weight·new."""
    return new if old is None else (1 - weight) * old + weight * new


class CalibrationInterrupted(Exception):
    """:meth:`VerifyCostCurve.measure` stopped because its ``should_stop`` said so (work arrived)."""


#: the lock file that makes the CPU measurements of one node's engines take turns (:func:`measuring_alone`)
CALIBRATION_LOCK = os.path.join(tempfile.gettempdir(), "dart-serve-calibration.lock")
_LOCK_WAIT_S = 120.0  # the longest wait for another engine's measurement; then this one measures anyway


@contextmanager
def measuring_alone(device: torch.device | str, should_stop: Callable[[], bool] | None = None,
                    path: str | None = None, wait_s: float = _LOCK_WAIT_S) -> Iterator[bool]:
    """Holds the node's calibration lock (an exclusive ``flock`` on ``path``, default
    :data:`CALIBRATION_LOCK`) while a CPU engine measures its verification cost, so that engines
    starting together on one node measure one after another instead of side by side, which
    priced a step far above its cost on a 2-core VM (``bench/results/live_corpus_served/``, the
    ``--interleave`` section).  On other devices
    (each engine on its own GPU) it does nothing.  Yields whether the lock is held: False when
    another holder kept it longer than ``wait_s`` seconds (logged; the measurement goes on
    without it) or the lock file cannot be opened.

    Raises:
        CalibrationInterrupted: ``should_stop`` answered True while waiting for the lock.
    """
    if torch.device(device).type != "cpu":
        yield False
        return
    import fcntl

    path = path or CALIBRATION_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        logger.warning("calibration lock %s not opened (%s); measuring without it", path, e)
        yield False
        return
    held, deadline = False, time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if should_stop is not None and should_stop():
                    raise CalibrationInterrupted("verification cost measurement stopped: work arrived") from None
                if time.monotonic() >= deadline:
                    logger.warning("another engine on this node held the calibration lock over %.0f s; "
                                   "measuring beside it", wait_s)
                    break
                time.sleep(0.05)
        yield held
    finally:
        if held:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@dataclass(frozen=True)
class VerifyCostCurve:
    """Verification latency (ms) against query tokens, linearly interpolated; optionally also against
    the batch size.

    ``nodes`` / ``ms`` are the batch-1 curve (one sequence verifying that many query tokens, root
    included).  ``batches`` / ``batch_ms`` (optional) hold the same measurement at larger batch sizes:
    ``batch_ms[j][i]`` is the latency of ``batches[j]`` sequences verifying ``nodes[i]`` query tokens
    each (the padded layout of :meth:`AdaptiveBudget.select_batch`).  :meth:`cost` prices a batch
    with them; without them it prices B sequences of n tokens as one of B · n (the linear layers
    see B · n rows), which on a GPU, where the batch-1 curve is flat up to its last size, priced
    a 16-sequence step of several hundred tokens like one token (``bench/results/gpu/``, fifth run).
    """

    nodes: tuple[int, ...]
    ms: tuple[float, ...]
    batches: tuple[int, ...] = ()
    batch_ms: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.batches) != len(self.batch_ms) or any(len(r) != len(self.nodes) for r in self.batch_ms):
            raise ValueError("batch_ms needs one row per batch size, each as long as nodes")
        if list(self.batches) != sorted(set(self.batches)) or any(b < 2 for b in self.batches):
            raise ValueError("batches must be ascending sizes >= 2 (batch 1 is nodes / ms)")

    def __call__(self, num_nodes: int | np.ndarray) -> np.ndarray:
        """ms for ``num_nodes`` query tokens at batch 1; beyond the last measured size, the last segment's slope."""
        return self._interp(num_nodes, self.ms)

    def _interp(self, num_nodes, ms) -> np.ndarray:
        n = np.asarray(num_nodes, dtype=np.float64)
        out = np.interp(n, self.nodes, ms)
        if len(self.nodes) >= 2:
            slope = max(0.0, (ms[-1] - ms[-2]) / (self.nodes[-1] - self.nodes[-2]))
            out = np.where(n > self.nodes[-1], ms[-1] + slope * (n - self.nodes[-1]), out)
        return out

    def cost(self, batch: int, per_sequence: int | np.ndarray) -> np.ndarray:
        """ms for ``batch`` sequences verifying ``per_sequence`` query tokens each (root included).

        With batch rows, linear in the batch size between the two measured sizes around ``batch``
        (batch 1 is the first), and beyond the largest along the last two sizes' slope; without
        them, ``self(batch · per_sequence)``."""
        if not self.batches or batch <= 1:
            return self(np.asarray(per_sequence) * max(batch, 1))
        sizes = (1,) + self.batches
        rows = (self.ms,) + self.batch_ms
        j = min(int(np.searchsorted(sizes, batch)), len(sizes) - 1)  # first measured size >= batch, or the last
        lo, hi = sizes[j - 1], sizes[j]
        c_lo, c_hi = self._interp(per_sequence, rows[j - 1]), self._interp(per_sequence, rows[j])
        return c_lo + (batch - lo) / (hi - lo) * np.maximum(c_hi - c_lo, 0.0)

    def ceiling(self, batch: int, alpha: float = 1.0, overhead_ms: float = 0.0) -> tuple[float, int]:
        """(the best speed-up over plain decoding, its query tokens per sequence) at ``batch``
        sequences, for chains accepted at ``alpha`` per node (:func:`chain_speedup`) whose
        speculative steps pay ``overhead_ms`` beyond their verification (drafting, tree search,
        host work; 0: the ceiling of ``bench/results/speculation_ceiling/``).  Where its
        best at ``alpha`` = 1 is one query token (plain decoding), speculation cannot pay at this
        batch size whatever the drafts.

        Raises:
            ValueError: ``alpha`` outside [0, 1]."""
        nodes = sorted(set(self.nodes) | {1})
        ms = self.cost(batch, np.asarray(nodes)) + np.where(np.asarray(nodes) > 1, overhead_ms, 0.0)
        return chain_speedup(ms, nodes, alpha)

    def calibration_lines(self, batches: tuple[int, ...] = (1, 2, 4, 8, 16),
                          alphas: tuple[float, ...] = (1.0, 0.8, 0.6)) -> list[str]:
        """One line per batch size of what the curve says about speculation there: plain decoding's
        ms per token, a draft node's cost per sequence, the break-even acceptance of a first node
        (cost(B, 2) / cost(B, 1) − 1) and the ceiling (speed-up, query tokens per sequence) at each
        acceptance of ``alphas``, drafting free.  The engine logs them at start-up."""
        lines = []
        for b in batches:
            one, two = (float(x) for x in self.cost(b, np.array([1, 2])))
            best = ", ".join("α {:g}: {:.2f}x at {} tokens".format(a, *self.ceiling(b, a)) for a in alphas)
            lines.append(f"batch {b}: plain {one / b:.2f} ms/token, a draft node {(two - one) / b:.2f} ms/sequence, "
                         f"break-even acceptance {two / one - 1:.2f}; ceiling with drafting free {best}")
        return lines

    @classmethod
    @torch.inference_mode()
    def measure(cls, target: TargetModel, node_counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64),
                context_len: int = 256, repeats: int = 5, batch_sizes: tuple[int, ...] = (1,),
                should_stop: Callable[[], bool] | None = None, log: bool = True) -> "VerifyCostCurve":
        """Times one verification forward per tree size (and batch size) after a ``context_len``-token
        prefix in every sequence.

        One untimed pass over every shape first (kernels, allocator, first-touch pages, CUDA graph
        captures: the first forwards of a process can take twice as long), then ``repeats`` passes,
        each over every shape in turn, so a slow moment of the machine falls on all shapes alike;
        each shape gets the median of its passes, and each batch size's curve is made
        non-decreasing in tokens (a bigger tree never costs less: a dip is noise, and the budget
        would chase it), each batch size's curve at least the smaller one's.

        Args:
            batch_sizes: the batch sizes measured (1 is always measured); more than 1 fills
                ``batches`` / ``batch_ms``.
            should_stop: asked before every timed forward; True abandons the measurement (an
                engine re-measuring while idle stops when a request arrives).
            log: log the curve and the calibration lines (:meth:`calibration_lines`).

        Raises:
            ValueError: a batch size below 1.
            CalibrationInterrupted: ``should_stop`` answered True.
        """
        node_counts = tuple(sorted(set(node_counts)))
        batch_sizes = tuple(sorted(set(batch_sizes) | {1}))
        if batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be >= 1, got {batch_sizes}")
        with measuring_alone(target.device, should_stop):
            curve = cls._measure(target, node_counts, context_len, repeats, batch_sizes, should_stop)
        if log:
            curve.log()
        return curve

    @classmethod
    def _measure(cls, target: TargetModel, node_counts: tuple[int, ...], context_len: int, repeats: int,
                 batch_sizes: tuple[int, ...], should_stop: Callable[[], bool] | None) -> "VerifyCostCurve":
        gen = torch.Generator().manual_seed(0)
        device = target.device
        caches, inputs = {}, {}
        for b in batch_sizes:
            prompts = torch.randint(0, target.config.vocab_size, (b, context_len), generator=gen).tolist()
            caches[b] = TargetCache(b, device)
            target.prefill(prompts, caches[b], last_logits=True)  # only the cache is used
            for n in node_counts:
                ids = torch.randint(0, target.config.vocab_size, (b, n), generator=gen).to(device)
                chain = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))[None].expand(b, n, n)
                inputs[b, n] = (ids, caches[b].lengths[:, None] + torch.arange(n, device=device)[None], chain)

        def timed(b: int, n: int) -> float:
            if should_stop is not None and should_stop():
                raise CalibrationInterrupted("verification cost measurement stopped: work arrived")
            cache = caches[b]
            ids, pos, chain = inputs[b, n]
            mask = cache_mask(cache.lengths, cache.padded_length, chain, target.dtype)
            sync_device(device)
            t0 = time.perf_counter()
            target.forward(ids, pos, mask, cache)
            sync_device(device)
            ms = 1e3 * (time.perf_counter() - t0)
            cache.compact(torch.zeros(b, 0, dtype=torch.long, device=device),
                          torch.zeros(b, dtype=torch.long, device=device))  # drop the tree again
            return ms

        shapes = [(b, n) for b in batch_sizes for n in node_counts]
        for b, n in shapes:  # warm-up, untimed
            timed(b, n)
        times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
        for _ in range(repeats):
            for s in shapes:
                times[s].append(timed(*s))
        rows, floor = [], np.zeros(len(node_counts))
        for b in batch_sizes:
            floor = np.maximum(floor, np.maximum.accumulate([statistics.median(times[b, n]) for n in node_counts]))
            rows.append(tuple(round(float(m), 3) for m in floor))
        return cls(node_counts, rows[0], batch_sizes[1:], tuple(rows[1:]))

    def log(self, what: str = "") -> None:
        """Logs the curve and, where it holds 1 and 2 query tokens, :meth:`calibration_lines`
        (``what``, e.g. ``"re-measured "``, leads each line)."""
        logger.info("%sverify cost (nodes -> ms): %s", what, dict(zip(self.nodes, self.ms)))
        for b, r in zip(self.batches, self.batch_ms):
            logger.info("%sverify cost at batch %d (nodes per sequence -> ms): %s", what, b, dict(zip(self.nodes, r)))
        if 1 in self.nodes and 2 in self.nodes:
            for line in self.calibration_lines():
                logger.info("%sspeculation calibration: %s", what, line)

    def minimum(self, other: "VerifyCostCurve") -> "VerifyCostCurve":
        """The point-wise lower of two measurements of the same shapes.  A busy machine only ever
        adds time to a forward, so the lower of two medians is the nearer to the step's own cost;
        both inputs' orderings (non-decreasing in tokens, each batch size at least the smaller
        one's) hold for their minimum too.

        Raises:
            ValueError: the two curves measured different shapes."""
        if (self.nodes, self.batches) != (other.nodes, other.batches):
            raise ValueError("the curves measured different shapes")
        low = lambda a, b: tuple(min(x, y) for x, y in zip(a, b))  # noqa: E731
        return VerifyCostCurve(self.nodes, low(self.ms, other.ms), self.batches,
                               tuple(low(a, b) for a, b in zip(self.batch_ms, other.batch_ms)))


def curve_shapes(device: torch.device | str, tree_budget: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (query tokens per sequence, batch sizes) that :meth:`VerifyCostCurve.measure` times for
    an engine whose trees hold at most ``tree_budget`` draft nodes.

    On a CPU, batch 1 only: a forward there costs in proportion to its tokens, so B sequences of
    n tokens are priced as one of B · n, and a larger batch would add seconds to start-up.  On an
    accelerator, batches of 4 and 16 as well: a graph-captured forward is flat in its tokens up to
    some size and the batch-1 curve cannot say where that ends."""
    sizes = tuple(sorted({1, 2, 4, 8, 16, 32, 48, tree_budget + 1}))
    return sizes, ((1,) if torch.device(device).type == "cpu" else (1, 4, 16))


def node_acceptance_estimates(tree: DraftTree) -> np.ndarray:
    """[N] product of the acceptance estimates along each node's path (root 1), from ``tree.probs``:
    the head's probability, or on a context chain the chain's evidence q when higher (docs/engine.md,
    "Context in the tree"), so every node is priced the same way."""
    est = np.ones(tree.num_nodes)
    probs = tree.probs.astype(np.float64)
    for i in range(1, tree.num_nodes):
        est[i] = est[tree.parents[i]] * probs[i]
    return est


class AdaptiveBudget:
    """Chooses each tree's size to maximise expected tokens per second (module docstring).

    Args:
        curve: verification latency vs tree size.
        ema: weight of the newest observation in the calibration factor.
        min_budget: draft nodes always verified, so the calibration keeps learning
            even when drafts look hopeless.
        depth_window: batch steps remembered by :meth:`search_depth`.
    """

    def __init__(self, curve: VerifyCostCurve, ema: float = 0.05, min_budget: int = 1, depth_window: int = 16,
                 lookup_preference: float = LOOKUP_PREFERENCE) -> None:
        if lookup_preference <= 0:
            raise ValueError("lookup_preference must be > 0")
        self.curve = curve
        self.ema = ema
        self.min_budget = min_budget
        self.calibration = 1.0
        self._predicted_with = 1.0  # the calibration of the last select_batch: its predictions carry it
        # decayed sums behind the calibration: accepted draft nodes, and their uncalibrated estimates (a
        # prior of one node at ratio 1, which fades with the first observations)
        self._accepted_sum = self._estimated_sum = 1.0
        self._overhead = StepTimeAverage(ema)  # draft + tree search per speculative step, ms
        self._unobserved = 0  # can_pay calls since the last speculative step was observed
        self._kept_depths: deque[int] = deque(maxlen=depth_window)  # deepest kept node of each recent batch step
        self._kept_nodes: deque[int] = deque(maxlen=depth_window)  # most draft nodes a tree kept, per batch step
        self._sized: dict[tuple[SearchParams, int], SearchParams] = {}  # search_params' answers
        self.lookup_preference = lookup_preference
        self._chain_counts: dict[int, list[float]] = {}  # match length -> [accepted, offered], decayed
        self._tree_rate: dict[int, float] = {}  # batch bucket -> tokens/ms of tree steps, EMA
        self.lookup_overhead_ms = 0.0  # wall time of a lookup step beyond t_verify, EMA
        self._can_pay: dict[tuple[int, float, float], bool] = {}  # can_pay's answers by (batch, overhead, α)
        self.remeasured = 0  # re-measurements of the curve done (remeasure)
        # decayed [rows that accepted a draft token, rows that verified one], trees and lookups alike
        self._first_level = [_FIRST_LEVEL_PRIOR, _FIRST_LEVEL_PRIOR]

    @property
    def overhead_ms(self) -> float:
        """Draft and tree-search time of a speculative step, ms: a moving average of weight ``ema``
        per sequence-step that leaves one-off stalls out (:class:`StepTimeAverage`); 0 before any."""
        return self._overhead.value

    @overhead_ms.setter
    def overhead_ms(self, ms: float) -> None:
        """Sets the average to ``ms``, taken as measured (:meth:`can_pay` prices it at once)."""
        self._overhead.reset()
        self._overhead.add(ms)
        self._overhead.count = max(self._overhead.count, _OVERHEAD_MIN_STEPS)
        self._unobserved = 0

    @property
    def first_level_acceptance(self) -> float:
        """The share of sequence-steps that verified draft tokens and accepted at least one (tree
        and lookup steps; decayed by 0.99 per row, 8 rows of acceptance 1 before any evidence)."""
        return self._first_level[0] / self._first_level[1]

    def _observe_first_level(self, hits: np.ndarray) -> None:
        """Rows in order, each True where it accepted a draft token (closed form of one update per row)."""
        self._first_level = [_decayed_sum(self._first_level[0], hits, _FIRST_LEVEL_DECAY),
                             _decayed_sum(self._first_level[1], np.ones(len(hits)), _FIRST_LEVEL_DECAY)]

    def state(self) -> dict:
        """The budget's live estimates, for operators (the engine's ``stats``): the calibration
        factor, the measured first-level acceptance, the drafting and search time per speculative
        step (ms, moving average) and the steps it left out as stalls, how often the curve was
        re-measured (:meth:`remeasure`), and the verification cost curve at batch 1 (query tokens -> ms)."""
        return {"calibration": round(self.calibration, 4),
                "first_level_acceptance": round(self.first_level_acceptance, 4),
                "overhead_ms": round(self.overhead_ms, 3), "overhead_stalls": self._overhead.stalls,
                "curve_remeasured": self.remeasured,
                "verify_ms": {int(n): float(m) for n, m in zip(self.curve.nodes, self.curve.ms)}}

    def remeasure(self, target: TargetModel, should_stop: Callable[[], bool] | None = None) -> VerifyCostCurve:
        """Measures the verification cost curve again, at the same shapes, and keeps the point-wise
        lower of the two (:meth:`VerifyCostCurve.minimum`); returns the curve now used.

        The start-up measurement of a served engine runs while the other replicas of the node
        start (imports, model loads, the trie), which can price a batch size's draft node so high
        that :meth:`can_pay` never says yes there.  An engine that re-measures once it is idle
        (:class:`dart_core.serve.batcher.ContinuousBatcher`, ``recalibrate_after_s``) prices
        speculation by what its steps cost once the node has settled.  ``can_pay``'s kept
        answers are dropped; the gate asks again before the next step.

        Raises:
            CalibrationInterrupted: ``should_stop`` answered True (the curve is unchanged).
        """
        new = VerifyCostCurve.measure(target, node_counts=self.curve.nodes, batch_sizes=(1,) + self.curve.batches,
                                      should_stop=should_stop, log=False)
        self.curve = self.curve.minimum(new)
        self._can_pay.clear()
        self.remeasured += 1
        self.curve.log("re-measured ")
        return self.curve

    def can_pay(self, batch: int) -> bool:
        """Whether speculation can pay at all with ``batch`` running sequences: some chain draft of
        at least one node per sequence, each node accepted with α = the measured
        :attr:`first_level_acceptance` + ``CAN_PAY_MARGIN`` (at most 1; a deeper level may accept
        more than the first), beats plain decoding when each speculative step pays the measured
        draft and search time (:attr:`overhead_ms`) on top of the verification cost curve
        (:meth:`VerifyCostCurve.ceiling` chooses more than one query token).  Before any evidence
        α is 1.  The speculation gate asks it before every step; the answer is kept per batch
        size, overhead (to 0.1 ms) and α (to 0.01).

        A batch size where it says no is never speculated at: no warm-up steps and no probes,
        whose cost showed at 8 clients in the continuous-batching benchmark, where speculation
        cannot win.  Smaller batches keep measuring the acceptance, and a batch size whose answer
        turns to yes is warmed up and probed again.  The overhead is only measured while some
        batch size speculates, so after ``_OVERHEAD_STALE_STEPS`` calls with no speculative step
        it is forgotten (0 until the next speculative step measures it again): a no that rests
        on an old overhead is revisited, at the cost of one warm-up per that many steps.  Where
        the ceiling with drafting free reaches ``_GRACE_CEILING`` (batch 1 on a CPU; larger batches
        on a GPU), nor is an overhead priced before ``_OVERHEAD_MIN_STEPS`` speculative steps
        measured it (0 until then): an engine's first speculative steps run cold, and served on a
        2-core Xeon a few of them said no for the next ``_OVERHEAD_STALE_STEPS`` steps while
        speculation, measured later, was well ahead; the gate's warm-up measures whole steps in
        the meantime.  Where the ceiling is lower the early no stands: there the warm-up it would
        let in costs more than it finds (served at 4 clients on the same machine; both in
        ``bench/results/gate/``)."""
        self._unobserved += 1
        if self._unobserved > _OVERHEAD_STALE_STEPS and self.overhead_ms > 0:
            self._overhead.reset()  # measured long ago; a no that rests on it would never be revisited
            self._unobserved = 0
        alpha = round(min(1.0, self.first_level_acceptance + CAN_PAY_MARGIN), 2)
        overhead = self.overhead_ms
        if (self._overhead.count < _OVERHEAD_MIN_STEPS and overhead > 0
                and self.curve.ceiling(batch, alpha)[0] >= _GRACE_CEILING):
            overhead = 0.0  # too few steps to price it where speculation can pay most
        key = (int(batch), round(overhead, 1), alpha)
        if key not in self._can_pay:
            if len(self._can_pay) >= 4096:  # a bound: the overhead wanders over many values in a long run
                self._can_pay.clear()
            self._can_pay[key] = self.curve.ceiling(batch, alpha, overhead)[1] > 1
        return self._can_pay[key]

    def search_depth(self, max_depth: int) -> int:
        """How deep the next step should draft and search (≤ ``max_depth``).

        One level deeper than the deepest node kept over the last ``depth_window``
        steps: levels nobody keeps cost draft-head slots and search time for
        nothing, and the extra level lets deeper trees come back when they pay.
        Before any step, ``max_depth``.
        """
        if not self._kept_depths:
            return max_depth
        return max(1, min(max_depth, max(self._kept_depths) + 1))

    def node_limit(self, max_nodes: int) -> int:
        """The most draft nodes the next tree needs (≤ ``max_nodes``): twice the most any tree kept
        over the last ``depth_window`` steps, at least 4, so trees can grow back when they pay.
        Before any step, ``max_nodes``."""
        if not self._kept_nodes:
            return max_nodes
        return min(max_nodes, max(4, 2 * max(self._kept_nodes)))

    def search_params(self, params: SearchParams) -> SearchParams:
        """The tree search sized to what this budget keeps: :meth:`node_limit` nodes, with a beam
        width no wider than that and a top-k no wider than that or 8, whichever is more, so that a
        step that verifies a few nodes does not search for ``params.budget`` (a tree of n nodes has
        at most n nodes on a level; the top-k keeps room for the n-gram term to promote a token the
        head ranks lower).  Before any step, ``params``."""
        if not self._kept_nodes:
            return params
        n = self.node_limit(params.budget)
        key = (params, n)
        if key not in self._sized:
            self._sized[key] = replace(params, budget=n, beam_width=min(params.beam_width, n),
                                       top_k=min(params.top_k, max(8, n)))
        return self._sized[key]

    def select(self, tree: DraftTree) -> tuple[DraftTree, float]:
        """Returns (the truncated tree, its predicted number of accepted draft nodes): :meth:`select_batch` at batch 1."""
        chosen, predicted = self.select_batch(TreeBatch.from_trees([tree]))
        return chosen.tree(0), float(predicted[0])

    def select_batch(self, trees: TreeBatch | list[DraftTree], packed: bool = False) -> tuple[TreeBatch, np.ndarray]:
        """Sizes the trees of a whole batch together (one verification forward for all of them).

        **Padded** (``packed=False``): the batch is verified with every tree padded
        to the largest, so a node count n costs ``curve.cost(B, n + 1)``
        (:meth:`VerifyCostCurve.cost`) whichever sequences use it: one sequence's seventh node makes all B
        sequences pay for seven.  Every tree therefore gets the same n (its n
        best nodes in its own rank order, so it stays prefix-closed; fewer if it
        has fewer), and n ≥ ``min_budget`` maximises

            (B + Σ_sequences Σ_{n best nodes} P(node accepted)) / (overhead + cost(B, n + 1))

        **Packed** (``packed=True``: the target computes only the real nodes,
        :meth:`dart_core.model.target.TargetModel.forward` ``rows``): every node of every
        tree competes for one budget of T nodes.  A node's value is its estimate
        capped by those of the nodes before it in its tree's rank order (so values
        fall along each tree and every prefix of the merged order is prefix-closed
        per tree); the merged order takes values high to low, and T ≥
        ``min_budget`` maximises

            (B + Σ_{T best nodes} P(node accepted)) / (overhead + curve(B + T))

        so one sequence may verify 20 nodes in a step where another verifies none.

        At batch 1 both are the per-tree choice of the module docstring.  The whole batch is
        ranked and cut in array operations over the :class:`~ngram_service.tree_search.TreeBatch`
        (no per-tree Python).

        Args:
            trees: B draft trees (their ``probs`` give the acceptance estimates), or a list of
                :class:`DraftTree` (packed first).
            packed: price the verification by real nodes (B + T query tokens)
                rather than the padded layout.

        Returns:
            (the truncated trees, [B] float64 predicted accepted draft nodes per tree).
        """
        if not isinstance(trees, TreeBatch):
            trees = TreeBatch.from_trees(trees)
        b = len(trees)
        self._predicted_with = self.calibration
        order, probs, sizes = self._ranked(trees)
        if packed and b > 1:
            keep = self._keep_counts_packed(probs, sizes)
        else:
            max_n = int(sizes.max()) if b else 0
            # cum[i, n]: predicted accepted nodes of sequence i's n best nodes (flat beyond its tree's size)
            cum = np.concatenate([np.zeros((b, 1)), np.cumsum(probs, axis=1)], axis=1)
            counts = np.arange(min(self.min_budget, max_n), max_n + 1)
            expected = b + cum[:, counts].sum(axis=0)
            padded = 1 + np.minimum(sizes[:, None], counts[None, :]).max(axis=0)  # nodes per tree, root included
            rate = expected / (self.overhead_ms + self.curve.cost(b, padded))
            n = int(counts[int(np.argmax(rate))])  # ties: the smallest tree
            keep = np.minimum(sizes, n)
        return self._keep_best(trees, order, probs, keep)

    def _ranked(self, trees: TreeBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order [B, N - 1]: each row's draft nodes in the search's rank order, then its padding;
        probs [B, N - 1]: their calibrated acceptance estimates in that order, ≤ 1, 0 past the row's
        draft nodes; sizes [B]: draft nodes per row).  The rank order is the search's (``eff``, the
        lowest score on the path, high to low, then depth, then node index)."""
        b, n = trees.tokens.shape
        sizes = trees.counts - 1
        if n == 1:
            return np.zeros((b, 0), np.int64), np.zeros((b, 0)), sizes
        eff, est = trees.path_values()
        node = np.broadcast_to(np.arange(n), (b, n))
        draft = trees.real & (node > 0)
        rows = np.broadcast_to(np.arange(b)[:, None], (b, n))
        # per row: draft nodes first, by eff desc, depth, index (lexsort: last key is primary)
        flat = np.lexsort((node.ravel(), trees.depths.ravel(), -np.where(draft, eff, 0.0).ravel(),
                           ~draft.ravel(), rows.ravel()))
        order = (flat.reshape(b, n) - (np.arange(b) * n)[:, None])[:, : n - 1]
        est = np.take_along_axis(est, order, axis=1)
        ranked = np.arange(n - 1)[None, :] < sizes[:, None]
        probs = np.where(ranked, np.minimum(est * self.calibration, 1.0), 0.0)
        return order, probs, sizes

    def _keep_counts_packed(self, probs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Draft nodes kept per row when every node of the batch competes for one budget (see
        :meth:`select_batch`, packed)."""
        b, m = probs.shape
        ranked = np.arange(m)[None, :] < sizes[:, None]
        # values capped along each tree's rank order, so every prefix of the merged order is prefix-closed
        value = np.minimum.accumulate(np.where(ranked, probs, np.inf), axis=1)
        owner = np.broadcast_to(np.arange(b)[:, None], (b, m))[ranked]
        rank = np.broadcast_to(np.arange(m), (b, m))[ranked]
        merged = np.lexsort((owner, rank, -value[ranked]))  # value high to low, then rank, then sequence
        gains = probs[ranked][merged]
        total = len(merged)
        counts = np.arange(min(self.min_budget, total), total + 1)
        expected = b + np.concatenate([[0.0], np.cumsum(gains)])[counts]
        rate = expected / (self.overhead_ms + self.curve(b + counts))
        t = int(counts[int(np.argmax(rate))])  # ties: the fewest nodes
        return np.bincount(owner[merged[:t]], minlength=b)

    def _keep_best(self, trees: TreeBatch, order: np.ndarray, probs: np.ndarray, keep_counts: np.ndarray
                   ) -> tuple[TreeBatch, np.ndarray]:
        """Each tree cut to its root and its ``keep_counts[i]`` best nodes (prefix-closed: rank
        order), with the predicted accepted nodes of what it keeps; notes the deepest kept node."""
        b = len(trees)
        keep_counts = np.asarray(keep_counts, dtype=np.int64)
        kept_rank = np.arange(order.shape[1])[None, :] < keep_counts[:, None]
        keep = np.zeros(trees.tokens.shape, dtype=bool)
        np.put_along_axis(keep, order, kept_rank, axis=1)
        keep[:, 0] = True  # the root: not in the order's ranked part (where it appears, unkept)
        out = trees.select(keep)
        kept = np.cumsum(np.where(kept_rank, probs, 0.0), axis=1)  # in rank order, as the rate summed them
        predicted = kept[:, -1] if kept.shape[1] else np.zeros(b)
        if b:
            self._kept_depths.append(out.max_depth)
            self._kept_nodes.append(int(keep_counts.max()))
        return out, predicted

    def observe(self, predicted: float, accepted: int, overhead_ms: float | None) -> None:
        """Feeds back one sequence-step: the predicted accepted draft nodes (:meth:`select_batch`'s,
        made with the calibration of that call) vs those accepted, and the step's draft+search time.

        The calibration is Σ accepted ÷ Σ (predicted ÷ that calibration), both sums decayed by
        ``1 − ema`` per sequence-step: a ratio of averages, so calibrated predictions match what
        is accepted on average.  (An average of the ratios accepted ÷ predicted, the earlier rule,
        settles at the square root of the true correction when predictions carry the calibration:
        c predicts c·e, and a ÷ (c·e) averages to c where c² = a ÷ e.)  A node whose calibrated
        estimate was capped at 1 counts its cap.
        """
        self.observe_batch(np.array([predicted], dtype=np.float64), np.array([accepted]), overhead_ms)

    def observe_batch(self, predicted: np.ndarray, accepted: np.ndarray, overhead_ms: float | None) -> None:
        """:meth:`observe` for the sequences of one step at once (predicted [B] and accepted [B] draft
        nodes, the step's draft+search time), in closed form: the same exponential averages as B calls
        in row order, up to rounding (the rows' predictions were all made with one calibration).
        ``overhead_ms`` None: the step's draft time is not typical (the draft head caught up on
        positions held while speculation was off) and leaves the overhead average alone."""
        m = len(predicted)
        if m == 0:
            return
        decay = 1.0 - self.ema
        if overhead_ms is not None:
            self._overhead.add(overhead_ms, m)
            self._unobserved = 0
        predicted = np.asarray(predicted, dtype=np.float64)
        live = predicted > 1e-6
        k = int(live.sum())
        if k:
            accepted = np.asarray(accepted, dtype=np.float64)[live]
            self._observe_first_level(accepted >= 1)
            self._accepted_sum = _decayed_sum(self._accepted_sum, accepted, decay)  # the newest row weighs most
            self._estimated_sum = _decayed_sum(self._estimated_sum, predicted[live] / self._predicted_with, decay)
            self.calibration = float(np.clip(self._accepted_sum / self._estimated_sum, 0.05, 20.0))

    # -- lookup steps: the request's context chain verified alone (module docstring) -------------

    def chain_acceptance(self, match_length: int) -> float:
        """r_m: estimated acceptance of a chain token whose predecessor was accepted, for a
        chain found by a suffix match of ``match_length`` tokens (prior 2/3 before any evidence;
        lengths from 9 on are learnt in the buckets 9–15, 16–31 and 32 on)."""
        accepted, offered = self._chain_counts.get(_match_bucket(match_length), (0.0, 0.0))
        return (accepted + _CHAIN_PRIOR[0]) / (offered + _CHAIN_PRIOR[1])

    def select_lookup(self, chains: list[ContextChain]) -> int:
        """Draft nodes per sequence for a lookup step of the batch, or 0: draft a tree instead.

        Args:
            chains: one context continuation per running sequence (an empty chain yields no node).

        Returns:
            n ≥ 1, the chain tokens each sequence verifies (its first n, fewer where its chain is
            shorter), when the expected rate (B + Σ_sequences Σ_{j ≤ n} r_m^j) / (overhead +
            t_verify(B, n + 1)) at its best n (:meth:`VerifyCostCurve.cost`) reaches
            ``lookup_preference`` × the measured tokens/ms of tree steps at this batch size; 0 when
            it does not, when no chain has a token, or before any tree step was measured (so the
            comparison has a reference).
        """
        b = len(chains)
        reference = self._tree_rate.get(SpeculationGate.bucket(b))
        longest = max((len(c.tokens) for c in chains), default=0)
        if reference is None or longest == 0:
            return 0
        cum = np.zeros((b, longest + 1))
        for i, c in enumerate(chains):
            if len(c.tokens):
                est = np.cumprod(np.full(len(c.tokens), self.chain_acceptance(c.match_length)))
                cum[i, 1:len(est) + 1] = np.cumsum(est)
                cum[i, len(est) + 1:] = cum[i, len(est)]
        counts = np.arange(1, longest + 1)
        rate = (b + cum[:, counts].sum(axis=0)) / (self.lookup_overhead_ms + self.curve.cost(b, counts + 1))
        best = int(np.argmax(rate))
        return int(counts[best]) if rate[best] >= self.lookup_preference * reference else 0

    def observe_lookup(self, match_length: int, offered: int, accepted: int) -> None:
        """Feeds back one sequence of a lookup step: ``offered`` chain tokens verified, the first
        ``accepted`` of them accepted (each accepted token's successor was reached too)."""
        reached = min(accepted + 1, offered)
        if offered >= 1:
            self._observe_first_level(np.array([accepted >= 1]))
        counts = self._chain_counts.setdefault(_match_bucket(match_length), [0.0, 0.0])
        counts[0] = _CHAIN_DECAY * counts[0] + accepted
        counts[1] = _CHAIN_DECAY * counts[1] + reached

    def observe_step(self, batch: int, lookup: bool, tokens: int, step_ms: float, verified_nodes: int) -> None:
        """Feeds back one speculative step's wall time (draft to acceptance) and tokens emitted
        (all sequences): a tree step updates the tree rate of its batch bucket, a lookup step the
        lookup overhead (its time beyond ``t_verify`` of ``verified_nodes`` query tokens)."""
        if step_ms <= 0:
            return
        if lookup:
            extra = max(0.0, step_ms - float(self.curve(verified_nodes)))
            self.lookup_overhead_ms = _ema(self.lookup_overhead_ms or None, extra, _TREE_RATE_EMA)
            return
        key = SpeculationGate.bucket(batch)
        self._tree_rate[key] = _ema(self._tree_rate.get(key), tokens / step_ms, _TREE_RATE_EMA)


class SpeculationGate:
    """Speculates only where it pays, measured online per batch-size bucket.

    For each bucket of running-sequence counts (1, 2, 3-4, 5-8, 9-16, ...:
    continuous batching moves the batch size often, and every bucket pays
    its own warm-up) the gate keeps exponential moving averages of the
    tokens a step emits and of its wall time (the step itself plus the
    caller's handling of its output), for speculative steps (draft, tree
    search, verification) and for plain autoregressive steps, and rates each
    mode by their ratio: tokens per millisecond of wall time.  (An average of
    each step's own tokens ÷ ms, the earlier rule, weighs a fast step like a
    slow one, so it overstates a mode whose step times vary: over the served
    Xeon's logs it overstated autoregressive steps by 21 % and speculative
    ones by 12 %, and replayed in text order it speculated less where
    speculation paid: ``bench/results/gate_estimator/``.)  A step speculates
    while its rate is at least the autoregressive one; the last ``probe_steps`` of every probe period run
    the other mode, so a change of content or load is seen.  The period
    starts at ``probe_every`` steps and doubles (up to ``max_probe_every``)
    each time a probe confirms the same winner, so a settled choice costs
    little.  The first ``settle_steps`` steps after a change of mode, and a
    bucket's first steps, are not measured (they carry the switch: the draft
    head catching up on the positions it skipped, and served, the n-gram
    service's process and the draft head's weights waking up after an
    autoregressive stretch; ``bench/results/gate/`` replays cold steps), nor
    is a speculative step whose draft catches up on more
    positions than one step can accept (positions held over steps that did
    not draft).  A new prompt's positions are folded into the head's KV cache
    at its prefill (``HeadTreeDrafter.fold_width``, on by default), so the first
    step after a prefill is measured like any other.
    The first ``warmup`` measured steps of a batch size speculate,
    the next ``warmup`` do not.  When a mode resumes after more than
    ``probe_every`` steps of the other, its old average counts as one step
    beside the new ones (their plain mean, up to ``1 / ema`` steps), so a
    probe is judged mostly by its own steps, not blended at weight ``ema``
    into measurements taken hundreds of steps earlier (under other prompts,
    or in the first steps of a fresh engine, whose one-off costs would
    otherwise keep a wrong first choice for thousands of steps, each probe
    confirming it and doubling the period); the winner, back after a short
    probe, keeps its long average.  Each average starts as the plain mean of its
    first ``1 / ema`` steps (so the first step does not weigh more than the
    next ones), and a step whose rate is off the average by more than
    ``outlier`` times is a hiccup, not a measurement: a slower one (a CUDA
    graph being captured, a garbage-collector pause, a reconnecting channel)
    is skipped, a faster one restarts the average (the earlier steps were the
    hiccup).  One such step among the first would otherwise decide the mode
    for hundreds of steps (found serving on an H200: ``bench/results/gpu/``).
    Output is unaffected: both modes are lossless.

    **Priced probes.**  A probe loses ``probe_steps`` × the loser's step time × (1 − the
    loser's rate ÷ the winner's) against running the winner, plus what the settling steps that
    resume speculation cost beyond speculative steps (the draft head catching up on the positions
    held while it was off, the cold steps after it; an average over switches); when a probe confirms the winner,
    the next period is also long enough that this loss stays within ``max_probe_share`` of the
    period's time at the winner's step time (mean wall ms per step of each mode, measured like
    the rates), up to ``max_probe_every``.
    **Batch sizes where speculation cannot pay** (``can_pay(batch)`` false: the engine asks
    the verification cost curve whether drafts accepted at the measured first-level rate plus a
    margin, at every level, would beat plain decoding there, at the measured drafting and search
    time: :meth:`AdaptiveBudget.can_pay`) never speculate: no warm-up, no probe.  Unless the
    bucket's own measurements say otherwise: where both modes have been measured (``warmup``
    steps each) and speculative steps emit more tokens per millisecond, the gate goes on
    deciding by its measurements (can_pay is a model of the step; the gate measures the whole
    step).  Served on a 2-core Xeon, can_pay's drafting and search average, set by a cold
    first step after each long autoregressive stretch, said no while the gate measured
    speculative steps well ahead (``bench/results/xeon_vnni/``).

    This is what :class:`AdaptiveBudget` cannot do by itself: its smallest
    tree still pays the draft and search overhead and a 2-token verification,
    which on a CPU with a weak head costs more than the tokens it wins
    (BENCHMARKS.md, verification cost curve).

    Args:
        ema: weight of the newest measured step in each average (its first
            ``1 / ema`` steps are a plain mean).  Speculative steps emit from one
            token to a dozen or more, so their average needs a long memory to tell
            a mode that pays from a break-even one (:mod:`dart_core.bench.gate_replay`
            replays measured steps through the gate at several settings; ``bench/results/gate/``).
        probe_every: first probe period, in steps of one bucket.
        max_probe_every: longest probe period.
        probe_steps: consecutive steps of the other mode per probe (more than
            ``settle_steps``, which are not measured).
        warmup: measured steps of each mode before the gate decides (a few steps of
            noisy speculative rates decide wrongly often enough to cost a short run
            a whole probe period: the replay's short runs).
        outlier: a step whose tokens/ms differ from its mode's average by more
            than this factor is not averaged (see above).
        max_probe_share: the most a settled bucket's probes may cost, as a share of its
            period's time (see above).
        can_pay: batch size -> whether speculation can pay there at all (None: everywhere).
        settle_steps: steps after each change of mode (and a bucket's first steps) that are
            not measured (see above; 3 with ``probe_steps`` 7 did not pay, replayed over served
            logs or served A/B on a 2-core Xeon: ``bench/results/gate/``).

    Raises:
        ValueError: settings out of range.
    """

    def __init__(self, ema: float = 0.02, probe_every: int = 64, probe_steps: int = 4, warmup: int = 8,
                 max_probe_every: int = 1024, outlier: float = 8.0, max_probe_share: float = 0.05,
                 can_pay: Callable[[int], bool] | None = None, settle_steps: int = 1) -> None:
        if (not (0 < ema <= 1) or not (1 <= settle_steps < probe_steps < probe_every <= max_probe_every)
                or warmup < 1 or not outlier > 1 or not 0 < max_probe_share < 1):
            raise ValueError("need 0 < ema <= 1, 1 <= settle_steps < probe_steps < probe_every <= max_probe_every, "
                             "warmup >= 1, outlier > 1 and 0 < max_probe_share < 1")
        self.settle_steps = settle_steps
        self.max_probe_share = max_probe_share
        self.can_pay = can_pay
        self.ema = ema
        self.outlier = outlier
        self.hiccups = 0  # steps left out of the averages as outliers
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_steps = probe_steps
        self.warmup = warmup
        self._buckets: dict[int, _GateBucket] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        """The bucket of a batch size: the next power of two (1, 2, 4, 8, ...)."""
        return 1 << max(0, int(batch) - 1).bit_length()

    def _stats(self, batch: int) -> "_GateBucket":
        key = self.bucket(batch)
        if key not in self._buckets:
            self._buckets[key] = _GateBucket(period=self.probe_every)
        return self._buckets[key]

    def speculate(self, batch: int) -> bool:
        """Whether the next step of ``batch`` running sequences should speculate."""
        if self.can_pay is not None and not self.can_pay(batch) and not self._measured_winner(batch):
            return False
        b = self._stats(batch)
        if b.seen[1] < self.warmup:
            return True
        if b.seen[0] < self.warmup:
            return False
        winner = b.rate[1] >= b.rate[0]
        b.steps += 1
        probing = b.steps > b.period - self.probe_steps
        if b.steps >= b.period:  # the period's probe ends with this step
            b.period = (min(max(2 * b.period, self._priced_period(b, winner)), self.max_probe_every)
                        if b.winner == winner else self.probe_every)
            b.winner = winner
            b.steps = 0
        return winner != probing

    def _measured_winner(self, batch: int) -> bool:
        """Whether ``batch``'s bucket measured both modes (``warmup`` steps each) and speculation
        emits more tokens per millisecond."""
        b = self._buckets.get(self.bucket(batch))
        return b is not None and min(b.seen) >= self.warmup and b.rate[1] > b.rate[0]

    def state(self) -> dict:
        """Per batch-size bucket (:meth:`bucket`), for operators: steps measured, tokens per ms and
        wall ms per step of each mode (moving averages), and the probe period, in steps."""
        return {str(k): {"measured_steps": {"autoregressive": b.seen[0], "speculative": b.seen[1]},
                         "tokens_per_ms": {"autoregressive": round(b.rate[0], 4), "speculative": round(b.rate[1], 4)},
                         "step_ms": {"autoregressive": round(b.step_ms[0], 3), "speculative": round(b.step_ms[1], 3)},
                         "probe_period": b.period} for k, b in sorted(self._buckets.items())}

    def _priced_period(self, b: "_GateBucket", winner: bool) -> int:
        """The shortest period whose probe costs at most ``max_probe_share`` of the period's time:
        ``probe_steps`` of the loser, each losing its step time × (1 − loser's rate ÷ winner's
        rate) against the winner, over a period of the winner's steps (0 before both were timed)."""
        w, l = int(winner), int(not winner)
        if min(b.step_ms) <= 0 or b.rate[w] <= 0:
            return 0
        # every period resumes speculation once (its probe, or the winner after it): the draft head's catch-up
        lost_ms = self.probe_steps * b.step_ms[l] * max(0.0, 1.0 - b.rate[l] / b.rate[w]) + (b.switch_ms or 0.0)
        return int(np.ceil(lost_ms / (self.max_probe_share * b.step_ms[w])))

    def observe(self, batch: int, speculative: bool, tokens: int, step_ms: float, typical: bool = True) -> None:
        """Feeds back one step: its mode, the tokens it emitted (all sequences) and its wall time.

        ``typical=False`` records the mode without measuring the step (the engine
        passes it for a draft that catches up on skipped positions).
        """
        b = self._stats(batch)
        k = int(speculative)
        switched = b.last is not None and b.last != speculative
        b.last = speculative
        if switched and b.streak >= self.probe_every:  # the other mode ran more than a probe period
            b.run[k] = min(b.run[k], 1)  # stale: the old average counts as one step beside the steps to come
        b.streak = 1 if switched else b.streak + 1
        if speculative and b.run[1] and step_ms > 0 and b.streak <= self.settle_steps:
            # resuming speculation: the settling steps' excess over a speculative step, priced into the period
            b.resume_ms = (0.0 if switched else b.resume_ms) + max(0.0, step_ms - b.step_ms[1])
            if b.streak == self.settle_steps:
                b.switch_ms = _ema(b.switch_ms, b.resume_ms, 0.25)
        if b.streak <= self.settle_steps or not typical or step_ms <= 0:  # settling (a bucket's first steps too)
            return
        rate = tokens / step_ms
        if b.run[k] and rate * self.outlier < b.rate[k]:  # a hiccup: skipped
            self.hiccups += 1
            return
        if b.run[k] and rate > self.outlier * b.rate[k]:  # the average so far was the hiccup
            self.hiccups += b.run[k]
            b.seen[k] -= b.run[k]  # those steps no longer count as measured (warm-up included)
            b.run[k] = 0
        weight = max(self.ema, 1 / (b.run[k] + 1))
        b.tokens[k] = _ema(b.tokens[k] if b.run[k] else None, float(tokens), weight)
        b.step_ms[k] = _ema(b.step_ms[k] if b.run[k] else None, step_ms, weight)
        b.rate[k] = b.tokens[k] / b.step_ms[k]  # a ratio of the averages: tokens per ms of wall time
        b.run[k] += 1
        b.seen[k] += 1

    def speedup(self, batch: int) -> float | None:
        """Measured speculative / autoregressive rate in the bucket of ``batch`` (None before both were measured)."""
        b = self._buckets.get(self.bucket(batch))
        if b is None or min(b.seen) == 0 or b.rate[0] <= 0:
            return None
        return b.rate[1] / b.rate[0]


@dataclass
class _GateBucket:
    """One batch-size bucket of :class:`SpeculationGate`; index 0 = autoregressive, 1 = speculative."""

    period: int  # current probe period, steps
    steps: int = 0  # steps decided in the current period
    winner: bool | None = None  # the mode that won at the end of the last period (True = speculative)
    last: bool | None = None  # mode of the last observed step
    rate: list[float] = field(default_factory=lambda: [0.0, 0.0])  # tokens / step_ms: tokens per ms of wall time
    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])  # tokens emitted per step, moving averages
    step_ms: list[float] = field(default_factory=lambda: [0.0, 0.0])  # wall ms per step, moving averages
    seen: list[int] = field(default_factory=lambda: [0, 0])  # steps measured
    streak: int = 0  # steps of the last observed mode in a row
    run: list[int] = field(default_factory=lambda: [0, 0])  # steps the current average weighs (1 + new ones on resuming)
    switch_ms: float | None = None  # what resuming speculation costs beyond its settling steps at the average, ms
    resume_ms: float = 0.0  # that excess so far, while the current resumption settles
