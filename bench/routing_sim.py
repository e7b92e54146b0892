"""The routing simulation: the policies themselves (pure, no servers) on synthetic chat traffic.

Workload (``make_workload``, seeded): conversations arrive as a Poisson process; each opens with
one of a few shared system prompts, chosen with Zipf popularity, and runs several turns. A turn's
prompt is the system prompt, then every earlier user message and reply, then the new user
message, so it extends the previous turn's prompt plus reply block for block. The next turn
arrives a think time (exponential) after the reply ends: arrivals of new conversations are open
loop, turns within one follow their replies.

Blocks stand for ``TOKENS_PER_BLOCK`` tokens and are named by chained keys (a system prompt's
block i, a conversation's block i), so equal keys mean equal prefixes, as the policies'
``prefix_block_hashes`` do for text.

Replicas (``simulate``): each is an LRU cache of ``capacity`` blocks, touched deepest block
first so that eviction trims chains from their ends, as TensorRT-LLM's leaf eviction does. A
request reuses the longest chain of its prompt's blocks the replica holds (never the last
block: the engine always computes at least one prompt token), and when it ends, its prompt and
reply blocks are cached. Its service time is ``BASE_S + PREFILL_S * uncached prompt tokens +
DECODE_S * reply tokens``; replicas serve requests concurrently (continuous batching), so the
in-flight counts a policy sees are those of the simulated clock.

The oracle is one LRU cache of the fleet's whole capacity that sees every request: the reuse a
single replica as large as the fleet would get. Load is each replica's busy time (the integral
of its in-flight count), reported as max over mean.

With ``proxies=2`` every turn goes to one of two independent policy instances at random (two
proxy instances that never talk), each seeing only its own in-flight counts, as a proxy does.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from policies import MAX_PREFIX_BLOCKS, Policy, ReplicaView, RequestFeatures

TOKENS_PER_BLOCK = 16
BASE_S = 0.02
PREFILL_S = 0.0002  # per uncached prompt token
DECODE_S = 0.01  # per reply token


@dataclass(frozen=True, slots=True)
class Conversation:
    id: int
    system: int  # which shared system prompt
    arrival: float
    user_blocks: tuple[int, ...]  # per turn
    reply_blocks: tuple[int, ...]  # per turn
    think_s: tuple[float, ...]  # before each turn after the first


@dataclass(frozen=True, slots=True)
class Workload:
    system_blocks: tuple[int, ...]  # length of each shared system prompt
    conversations: tuple[Conversation, ...]

    @property
    def requests(self) -> int:
        return sum(len(c.user_blocks) for c in self.conversations)


@dataclass(frozen=True, slots=True)
class Shape:
    """The traffic per replica; the fleet's rate and conversation count scale with it."""

    conversations_per_replica: int = 100
    rate_per_replica: float = 2.0  # new conversations per second per replica
    systems: int = 6
    zipf_s: float = 1.1
    system_blocks: tuple[int, int] = (32, 128)  # 512 to 2,048 tokens
    turns: tuple[int, int] = (2, 8)
    user_blocks: tuple[int, int] = (1, 12)
    reply_blocks: tuple[int, int] = (2, 8)
    think_mean_s: float = 4.0


def make_workload(replicas: int, shape: Shape, seed: int) -> Workload:
    """The same conversations for the same arguments, on any machine."""
    rng = random.Random(seed)
    systems = tuple(rng.randint(*shape.system_blocks) for _ in range(shape.systems))
    weights = [1 / (rank + 1) ** shape.zipf_s for rank in range(shape.systems)]
    rate = shape.rate_per_replica * replicas
    clock, conversations = 0.0, []
    for cid in range(shape.conversations_per_replica * replicas):
        clock += rng.expovariate(rate)
        turns = rng.randint(*shape.turns)
        conversations.append(
            Conversation(
                id=cid,
                system=rng.choices(range(shape.systems), weights)[0],
                arrival=clock,
                user_blocks=tuple(rng.randint(*shape.user_blocks) for _ in range(turns)),
                reply_blocks=tuple(rng.randint(*shape.reply_blocks) for _ in range(turns)),
                think_s=tuple(rng.expovariate(1 / shape.think_mean_s) for _ in range(turns)),
            )
        )
    return Workload(systems, tuple(conversations))


class BlockCache:
    """An LRU cache of chained block keys, evicting chains from their ends."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[str, None] = OrderedDict()

    def reuse(self, blocks: Sequence[str]) -> int:
        """How many leading blocks (all but the last at most) are cached; touches them."""
        n = 0
        limit = len(blocks) - 1
        while n < limit and blocks[n] in self._blocks:
            n += 1
        for i in range(n - 1, -1, -1):
            self._blocks.move_to_end(blocks[i])
        return n

    def store(self, blocks: Sequence[str]) -> None:
        cache = self._blocks
        for i in range(len(blocks) - 1, -1, -1):
            cache[blocks[i]] = None
            cache.move_to_end(blocks[i])
        while len(cache) > self.capacity:
            cache.popitem(last=False)


@dataclass
class Outcome:
    """What one simulated run measured."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    requests: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)
    span_s: float = 0.0  # first arrival to last completion

    @property
    def reuse_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_over_mean(self) -> float:
        """The busiest replica's busy time over the mean busy time."""
        busy = list(self.busy_s.values())
        return max(busy) * len(busy) / sum(busy) if busy and sum(busy) else 0.0

    @property
    def mean_in_flight(self) -> float:
        """Requests in flight per replica, averaged over the run."""
        busy = list(self.busy_s.values())
        return sum(busy) / len(busy) / self.span_s if busy and self.span_s else 0.0


class _Chains:
    """Block keys of system prompts and conversations, built once and sliced per turn."""

    def __init__(self, workload: Workload) -> None:
        self.systems = [
            tuple(f"s{j}.{i}" for i in range(n)) for j, n in enumerate(workload.system_blocks)
        ]
        self._conv: dict[int, tuple[str, ...]] = {}

    def blocks(self, conv: Conversation, length: int) -> tuple[str, ...]:
        chain = self._conv.get(conv.id)
        if chain is None:
            total = sum(conv.user_blocks) + sum(conv.reply_blocks)
            chain = self._conv[conv.id] = tuple(f"c{conv.id}.{i}" for i in range(total))
        return self.systems[conv.system] + chain[:length]


# A pending event: (time, tie-breaker, conversation, turn, the request's route or None).
_Event = tuple[float, int, Conversation, int, "_Route | None"]


@dataclass(frozen=True, slots=True)
class _Route:
    proxy: int
    replica: str
    cached_after: tuple[str, ...]  # prompt and reply blocks, cached when the request ends


class _Run:
    """One simulated run: replicas' caches and busy time, each proxy's in-flight views."""

    def __init__(
        self, ids: Sequence[str], capacity: int, policies: Sequence[Policy], seed: int
    ) -> None:
        self.ids = list(ids)
        self.caches = {rid: BlockCache(capacity) for rid in ids}
        self.policies = list(policies)
        proxies = max(1, len(self.policies))
        self.views = [
            [ReplicaView(rid, True, False, False, 0) for rid in ids] for _ in range(proxies)
        ]
        self.slot = {rid: i for i, rid in enumerate(ids)}
        self.pick = random.Random(seed)
        self.outcome = Outcome(busy_s=dict.fromkeys(ids, 0.0))

    def arrive(
        self, now: float, chains: _Chains, conv: Conversation, turn: int
    ) -> tuple[float, _Route]:
        """Route one turn's request and start it; when it ends and what it will cache."""
        done = sum(conv.user_blocks[: turn + 1]) + sum(conv.reply_blocks[:turn])
        prompt = chains.blocks(conv, done)
        proxy = self.pick.randrange(len(self.views))
        rid = self._route(proxy, prompt, now) if self.policies else self.ids[0]
        reused = self.caches[rid].reuse(prompt)
        out = self.outcome
        out.requests += 1
        out.prompt_tokens += len(prompt) * TOKENS_PER_BLOCK
        out.reused_tokens += reused * TOKENS_PER_BLOCK
        uncached = (len(prompt) - reused) * TOKENS_PER_BLOCK
        reply = conv.reply_blocks[turn] * TOKENS_PER_BLOCK
        service = BASE_S + PREFILL_S * uncached + DECODE_S * reply
        out.busy_s[rid] += service
        cached_after = chains.blocks(conv, done + conv.reply_blocks[turn])
        return now + service, _Route(proxy, rid, cached_after)

    def finish(self, route: _Route) -> None:
        self.caches[route.replica].store(route.cached_after)
        if self.policies:
            self._count(route.proxy, route.replica, -1)
            self.policies[route.proxy].on_finish(route.replica)

    def _route(self, proxy: int, prompt: tuple[str, ...], now: float) -> str:
        policy = self.policies[proxy]
        tokens = len(prompt) * TOKENS_PER_BLOCK
        features = RequestFeatures(prompt[:MAX_PREFIX_BLOCKS], tokens, "m")
        decision = policy.select(features, self.views[proxy])
        policy.on_start(decision.replica, features, now)
        self._count(proxy, decision.replica, +1)
        return decision.replica

    def _count(self, proxy: int, rid: str, delta: int) -> None:
        views, i = self.views[proxy], self.slot[rid]
        views[i] = ReplicaView(rid, True, False, False, views[i].in_flight + delta)


def simulate(
    workload: Workload,
    make_policy: Callable[[], Policy] | None,
    replicas: int,
    capacity: int,
    *,
    proxies: int = 1,
    seed: int = 0,
) -> Outcome:
    """Play the workload through ``proxies`` instances of a policy; None is the oracle."""
    if make_policy is None:
        run = _Run(["oracle"], capacity * replicas, [], seed)
    else:
        ids = [f"r{i + 1}" for i in range(replicas)]
        run = _Run(ids, capacity, [make_policy() for _ in range(proxies)], seed)
    chains = _Chains(workload)
    events: list[_Event] = [(c.arrival, c.id, c, 0, None) for c in workload.conversations]
    heapq.heapify(events)
    order = len(events)
    now = 0.0
    while events:
        now, _, conv, turn, route = heapq.heappop(events)
        order += 1
        if route is None:
            end, started = run.arrive(now, chains, conv, turn)
            heapq.heappush(events, (end, order, conv, turn, started))
            continue
        run.finish(route)
        if turn + 1 < len(conv.user_blocks):
            heapq.heappush(events, (now + conv.think_s[turn + 1], order, conv, turn + 1, None))
    run.outcome.span_s = now - workload.conversations[0].arrival
    return run.outcome
