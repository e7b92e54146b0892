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
from dataclasses import dataclass

from policies import Policy, ReplicaView, RequestFeatures

TOKENS_PER_BLOCK = 16
MAX_PREFIX_BLOCKS = 256  # what the proxy hashes (router/dispatch.py)
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

    conversations_per_replica: int = 60
    rate_per_replica: float = 1.0  # new conversations per second per replica
    systems: int = 6
    zipf_s: float = 1.1
    system_blocks: tuple[int, int] = (32, 128)  # 512 to 2,048 tokens
    turns: tuple[int, int] = (2, 8)
    user_blocks: tuple[int, int] = (1, 12)
    reply_blocks: tuple[int, int] = (2, 8)
    think_mean_s: float = 8.0


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
    prompt_tokens: int = 0
    reused_tokens: int = 0
    busy_s: dict[str, float] | None = None

    @property
    def reuse_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_over_mean(self) -> float:
        busy = list((self.busy_s or {}).values())
        return max(busy) / (sum(busy) / len(busy)) if busy and sum(busy) else 0.0


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


class _Fleet:
    """Replicas' caches and busy time, and each proxy's in-flight views of them."""

    def __init__(self, ids: Sequence[str], capacity: int, proxies: int) -> None:
        self.caches = {rid: BlockCache(capacity) for rid in ids}
        self.busy = dict.fromkeys(ids, 0.0)
        self.views = [
            [ReplicaView(rid, True, False, False, 0) for rid in ids] for _ in range(proxies)
        ]
        self.slot = {rid: i for i, rid in enumerate(ids)}

    def add(self, proxy: int, rid: str, delta: int) -> None:
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
    """Play the workload through ``proxies`` instances of a policy (None: the oracle)."""
    oracle = make_policy is None
    ids = ["oracle"] if oracle else [f"r{i + 1}" for i in range(replicas)]
    fleet = _Fleet(ids, capacity * replicas if oracle else capacity, proxies)
    policies = [] if make_policy is None else [make_policy() for _ in range(proxies)]
    chains, pick, outcome = _Chains(workload), random.Random(seed), Outcome()
    # Events: (time, order, kind, conversation, turn, payload); kind 0 = a turn arrives.
    events: list[tuple[float, int, int, Conversation, int, tuple[object, ...]]] = []
    for conv in workload.conversations:
        events.append((conv.arrival, conv.id, 0, conv, 0, ()))
    heapq.heapify(events)
    order = len(workload.conversations)
    while events:
        now, _, kind, conv, turn, payload = heapq.heappop(events)
        if kind == 1:
            proxy, rid, stored = payload
            assert isinstance(proxy, int) and isinstance(rid, str) and isinstance(stored, tuple)
            fleet.caches[rid].store(stored)
            if not oracle:
                fleet.add(proxy, rid, -1)
                policies[proxy].on_finish(rid)
            if turn + 1 < len(conv.user_blocks):
                order += 1
                arrival = now + conv.think_s[turn + 1]
                heapq.heappush(events, (arrival, order, 0, conv, turn + 1, ()))
            continue
        done = sum(conv.user_blocks[: turn + 1]) + sum(conv.reply_blocks[:turn])
        prompt = chains.blocks(conv, done)
        proxy = pick.randrange(proxies)
        rid = ids[0] if oracle else _route(policies[proxy], fleet.views[proxy], prompt, now)
        if not oracle:
            fleet.add(proxy, rid, +1)
        reused = fleet.caches[rid].reuse(prompt)
        tokens, uncached = len(prompt) * TOKENS_PER_BLOCK, (len(prompt) - reused) * TOKENS_PER_BLOCK
        outcome.prompt_tokens += tokens
        outcome.reused_tokens += reused * TOKENS_PER_BLOCK
        reply = conv.reply_blocks[turn] * TOKENS_PER_BLOCK
        service = BASE_S + PREFILL_S * uncached + DECODE_S * reply
        fleet.busy[rid] += service
        stored = chains.blocks(conv, done + conv.reply_blocks[turn])
        order += 1
        heapq.heappush(events, (now + service, order, 1, conv, turn, (proxy, rid, stored)))
    outcome.busy_s = fleet.busy
    return outcome


def _route(policy: Policy, views: list[ReplicaView], prompt: tuple[str, ...], now: float) -> str:
    features = RequestFeatures(prompt[:MAX_PREFIX_BLOCKS], len(prompt) * TOKENS_PER_BLOCK, "m")
    decision = policy.select(features, views)
    policy.on_start(decision.replica, features, now)
    return decision.replica
