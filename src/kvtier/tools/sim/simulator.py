"""Discrete-event simulation of a fleet of replicas replaying a trace.

Model (every choice here is a stated assumption, see docs/sim.md):

- N replicas, each a first-come-first-served prefill server with its own L0 (engine) and L1
  (host memory) caches; one L2 pool shared by all, with its own capacity and an aggregate read
  rate that all replicas queue for.
- On arrival the router's strategy (`kvtier.router.policies`, unchanged) picks a replica from
  `ReplicaView`s counted as the real router counts them: requests in flight (routed, until their
  last output token) and uncached prompt tokens routed but not yet at first token (prompt minus
  the decision's `cached_tokens`, plus the read time of slower tiers: `work_tokens`).
- When a replica starts a request it walks the prompt's blocks: each block comes from the best
  tier holding it (L0 > L1 > L2); the walk stops at the first block held nowhere (prefix caching
  is contiguous) or held only where reading is slower than recomputing. The start waits for the
  loads (L1 and L2 in parallel), then prefills the rest: TTFT = queueing + overhead + loads +
  prefill (`model.CostModel`).
- At first token every tier sees every block of the request (an inclusive, write-through
  hierarchy: the engine keeps them in L0, the connector writes them to L1 and L2, and re-writing
  refreshes a block's recency); evictions follow each tier's policy (`caches`; `lru` evicts
  chains tail-first, as kvtier's L1 and vLLM's prefix cache do). Decode then keeps the request
  in flight for `output_tokens / decode_tokens_per_s`.
- Each cache change is published to the kvaware index as the connector's KV events would be,
  net of the step: `remove` of the blocks evicted and not held any more, `insert` of the blocks
  new to the tier and still held, for the replica and tier, L2 under the pseudo-replica
  `SHARED`.

One replica with one infinite tier therefore hits exactly the blocks seen before (the trace's
ideal hit rate), and one finite LRU tier equals a tail-first LRU over the requests in trace
order.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.base import Tier
from kvtier.router.index import SHARED, PrefixIndex
from kvtier.router.policies import ReplicaView, RouteRequest, work_tokens
from kvtier.tools.sim.caches import EVICTION, BlockCache, make_cache
from kvtier.tools.sim.cost_model import CostModel
from kvtier.tools.sim.report import ReplicaReport, SimResult, max_over_mean, percentile_ms
from kvtier.tools.sim.routing import build_strategy
from kvtier.tools.sim.trace import Trace, TraceRequest, block_hash

__all__ = ["FleetConfig", "simulate"]


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The simulated fleet. Capacities are in trace blocks; `math.inf` is unbounded."""

    replicas: int = 1
    l0_blocks: float = math.inf
    """Engine (GPU) prefix cache per replica."""
    l1_blocks: float = 0
    """Host-memory tier per replica (0: none)."""
    l2_blocks: float = 0
    """Shared pool for the whole fleet (0: none)."""
    l0_eviction: str = "lru"
    l1_eviction: str = "lru"
    l2_eviction: str = "lru"
    strategy: str = "kvaware"
    """A name from `kvtier.router.policies.POLICIES`."""
    strategy_options: Mapping[str, object] = field(default_factory=dict)
    """Constructor options of the strategy; `CostWeights` field names go into its weights."""
    seed: int = 0
    """Seed of the `random.Random` given to the strategy (tie-breaks)."""
    index_max_blocks: int = 4_000_000
    """Entry bound of the kvaware index; large enough to mirror every simulated cache."""

    def __post_init__(self) -> None:
        if self.replicas <= 0:
            raise ConfigError(f"replicas: must be positive, got {self.replicas}")
        for tier in ("l0", "l1", "l2"):
            blocks = getattr(self, f"{tier}_blocks")
            if not (blocks >= 0 and (math.isinf(blocks) or blocks == int(blocks))):
                raise ConfigError(
                    f"{tier}_blocks: must be a whole number >= 0 or inf, got {blocks}"
                )
            policy = getattr(self, f"{tier}_eviction")
            if policy not in EVICTION:
                raise ConfigError(
                    f"{tier}_eviction: unknown policy {policy!r}; choose from "
                    f"{', '.join(sorted(EVICTION))}"
                )
        if self.index_max_blocks <= 0:
            raise ConfigError(f"index_max_blocks: must be positive, got {self.index_max_blocks}")

    def describe(self) -> dict[str, object]:
        """JSON-friendly form (inf as the string "inf")."""

        def cap(v: float) -> object:
            return "inf" if math.isinf(v) else int(v)

        return {
            "replicas": self.replicas,
            "l0_blocks": cap(self.l0_blocks),
            "l1_blocks": cap(self.l1_blocks),
            "l2_blocks": cap(self.l2_blocks),
            "eviction": {"l0": self.l0_eviction, "l1": self.l1_eviction, "l2": self.l2_eviction},
            "strategy": self.strategy,
            "strategy_options": dict(self.strategy_options),
            "seed": self.seed,
        }


@dataclass(slots=True)
class _Job:
    request: TraceRequest
    expected_uncached: int
    """Prompt tokens the router counted as uncached (released at first token)."""
    started_s: float = 0.0


@dataclass(slots=True)
class _Replica:
    name: str
    tiers: list[tuple[Tier, BlockCache]]
    """This replica's L0 and L1, then the shared L2: only tiers with capacity."""
    queue: deque[_Job] = field(default_factory=deque)
    busy: bool = False
    in_flight: int = 0
    queued_prefill_tokens: int = 0
    routed: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0


_PREFILL_DONE, _DECODE_DONE = 0, 1


class _Fleet:
    """Mutable state of one run; `run` replays the trace once."""

    def __init__(self, trace: Trace, config: FleetConfig, costs: CostModel) -> None:
        self.trace = trace
        self.config = config
        self.costs = costs
        strategy = build_strategy(config.strategy, config.strategy_options, config.index_max_blocks)
        self.policy = strategy.policy
        self.index: PrefixIndex | None = strategy.index
        self.rng = random.Random(config.seed)
        shared: list[tuple[Tier, BlockCache]] = []
        if config.l2_blocks > 0:
            shared.append((Tier.L2, make_cache(config.l2_eviction, config.l2_blocks)))
        self.replicas: list[_Replica] = []
        width = len(str(config.replicas - 1))
        for i in range(config.replicas):
            own = [
                (tier, make_cache(policy, blocks))
                for tier, policy, blocks in (
                    (Tier.L0, config.l0_eviction, config.l0_blocks),
                    (Tier.L1, config.l1_eviction, config.l1_blocks),
                )
                if blocks > 0
            ]
            self.replicas.append(_Replica(f"r{i:0{width}d}", own + shared))
        self.by_name = {r.name: r for r in self.replicas}
        self.loadable = {tier: costs.worth_loading(tier) for tier in Tier}
        self.pool_free_s = 0.0
        self.events: list[tuple[float, int, int, _Replica, _Job]] = []
        self.seq = 0
        self.ttft_s: list[float] = []
        self.queue_s: list[float] = []
        self.hit_blocks: Counter[Tier] = Counter()
        self.hit_tokens = 0
        self.reasons: Counter[str] = Counter()
        self.last_first_token_s = 0.0

    # ----- event loop -----

    def run(self, progress: bool) -> None:
        bar = tqdm(
            total=len(self.trace), unit="req", disable=not progress, leave=False, mininterval=0.5
        )
        for n, request in enumerate(self.trace, 1):
            self._drain(until=request.arrival_s)
            self._arrive(request)
            if n % 256 == 0:
                bar.update(256)
        self._drain(until=math.inf)
        bar.update(len(self.trace) % 256)
        bar.close()

    def _drain(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            now, _, kind, replica, job = heapq.heappop(self.events)
            if kind == _PREFILL_DONE:
                self._first_token(replica, job, now)
            else:
                replica.in_flight -= 1

    def _schedule(self, at: float, kind: int, replica: _Replica, job: _Job) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, replica, job))

    # ----- request lifecycle -----

    def _arrive(self, request: TraceRequest) -> None:
        now = request.arrival_s
        views = [ReplicaView(r.name, r.in_flight, r.queued_prefill_tokens) for r in self.replicas]
        route = RouteRequest(request.hashes, self.trace.block_tokens, request.input_tokens)
        decision = self.policy.choose(route, views, self.rng, now)
        self.policy.observe_routed(route, decision, now)
        self.reasons[decision.reason] += 1
        replica = self.by_name[decision.replica]
        job = _Job(request, work_tokens(route, decision))
        replica.routed += 1
        replica.in_flight += 1
        replica.queued_prefill_tokens += job.expected_uncached
        replica.queue.append(job)
        if not replica.busy:
            self._start(replica, now)

    def _start(self, replica: _Replica, now: float) -> None:
        job = replica.queue.popleft()
        replica.busy = True
        job.started_s = now
        request = job.request
        counts = self.trace.block_token_counts(request)
        loaded = {Tier.L1: 0, Tier.L2: 0}
        served: dict[Tier, list[int]] = {tier: [] for tier, _ in replica.tiers}
        cached = 0
        for block, tokens in zip(request.blocks, counts, strict=True):
            tier = self._holder(replica, block)
            if tier is None or not self.loadable[tier]:
                break
            served[tier].append(block)
            self.hit_blocks[tier] += 1
            cached += tokens
            if tier is not Tier.L0:
                loaded[tier] += tokens
        for tier, cache in replica.tiers:
            cache.touch_chain(served[tier], now)
        self.hit_tokens += cached
        computed = request.input_tokens - cached
        l2_end = now
        if loaded[Tier.L2]:
            pool_start = max(now, self.pool_free_s)
            self.pool_free_s = pool_start + self.costs.pool_s(loaded[Tier.L2])
            l2_end = max(now + self.costs.read_s(Tier.L2, loaded[Tier.L2]), self.pool_free_s)
        loads_end = max(now + self.costs.read_s(Tier.L1, loaded[Tier.L1]), l2_end)
        done = loads_end + self.costs.request_overhead_s + self.costs.prefill_s(computed)
        replica.busy_s += done - now
        replica.prefill_tokens += computed
        self._schedule(done, _PREFILL_DONE, replica, job)

    @staticmethod
    def _holder(replica: _Replica, block: int) -> Tier | None:
        """Best tier holding `block` for this replica (no side effect)."""
        for tier, cache in replica.tiers:
            if block in cache:
                return tier
        return None

    def _first_token(self, replica: _Replica, job: _Job, now: float) -> None:
        request = job.request
        self.ttft_s.append(now - request.arrival_s)
        self.last_first_token_s = now
        self.queue_s.append(job.started_s - request.arrival_s)
        replica.queued_prefill_tokens -= job.expected_uncached
        for tier, cache in replica.tiers:
            new = [block for block in request.blocks if block not in cache]
            evicted = cache.put_chain(request.blocks, now)
            self._publish(replica, tier, cache, new, evicted, now)
        self._schedule(now + self.costs.decode_s(request.output_tokens), _DECODE_DONE, replica, job)
        replica.busy = False
        if replica.queue:
            self._start(replica, now)

    def _publish(
        self,
        replica: _Replica,
        tier: Tier,
        cache: BlockCache,
        new: list[int],
        evicted: list[int],
        now: float,
    ) -> None:
        """KV events of one tier after a request, net of the step: the blocks `new` to the
        tier that it still holds are stored, the `evicted` ones it no longer holds removed.

        A block can be both new and evicted within one step (a chain longer than the tier, or
        a held block evicted before the chain re-admits it); publishing the raw lists in
        either order would leave the index disagreeing with the cache."""
        if self.index is None:
            return
        holder = SHARED if tier is Tier.L2 else replica.name
        gone = [block_hash(b) for b in evicted if b not in cache]
        stored = [block_hash(b) for b in new if b in cache]
        if gone:
            self.index.remove(holder, gone, tier)
        if stored:
            self.index.insert(holder, stored, tier, now)

    # ----- results -----

    def result(self, wall_s: float, cpu_s: float) -> SimResult:
        total_blocks = self.trace.total_blocks()
        total_tokens = sum(r.input_tokens for r in self.trace)
        hits = sum(self.hit_blocks.values())
        first = self.trace.requests[0].arrival_s if len(self.trace) else 0.0

        def rate(n: int, d: int) -> float:
            return n / d if d else 0.0

        return SimResult(
            requests=len(self.trace),
            blocks=total_blocks,
            hit_rate=rate(hits, total_blocks),
            ideal_hit_rate=self.trace.ideal_hit_rate(),
            hit_rate_by_tier={t.value: rate(self.hit_blocks[t], total_blocks) for t in Tier},
            token_hit_rate=rate(self.hit_tokens, total_tokens),
            ttft_p50_ms=percentile_ms(self.ttft_s, 50),
            ttft_p90_ms=percentile_ms(self.ttft_s, 90),
            ttft_p99_ms=percentile_ms(self.ttft_s, 99),
            ttft_mean_ms=1000.0 * sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else 0.0,
            queue_p50_ms=percentile_ms(self.queue_s, 50),
            queue_p99_ms=percentile_ms(self.queue_s, 99),
            load_max_over_mean=max_over_mean([r.routed for r in self.replicas]),
            work_max_over_mean=max_over_mean([r.busy_s for r in self.replicas]),
            reasons=dict(sorted(self.reasons.items())),
            replicas=[
                ReplicaReport(r.name, r.routed, r.busy_s, r.prefill_tokens) for r in self.replicas
            ],
            sim_span_s=max(0.0, self.last_first_token_s - first),
            wall_s=wall_s,
            cpu_s=cpu_s,
            config={**self.config.describe(), "costs": asdict(self.costs)},
        )


def simulate(
    trace: Trace, config: FleetConfig, costs: CostModel, *, progress: bool = False
) -> SimResult:
    """Replay `trace` through the fleet once; deterministic for a given config and seed."""
    wall, cpu = time.perf_counter(), time.process_time()
    fleet = _Fleet(trace, config, costs)
    fleet.run(progress)
    return fleet.result(time.perf_counter() - wall, time.process_time() - cpu)
