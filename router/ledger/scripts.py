"""The chain's Lua scripts: each touches one replica's keys (one hash tag) and runs atomically.

A replica's chain is the hash ``kvl:{replica:ID}:cache``: ``generation``, ``seq`` (requests
served in this generation), ``state``, ``known`` ("1" when the state descends from a cache seen
empty, "0" when it does not), ``engine_digest``, ``counter`` (the replica's request counter when the
generation began), ``since`` and ``reason``.

- ``ENSURE``: the head, creating the chain when absent. A new chain's generation is Redis' clock
  in milliseconds, so after Redis lost everything a replica's generation numbers still never
  repeat (they grow by one per change, far slower than the clock); its state is genesis only
  when the caller proved the cache empty, else a fresh *unknown* fingerprint that equals no
  other. A changed engine digest, or a request counter below its value when the generation
  began (the replica restarted while no proxy watched), starts a new generation the same way.
- ``NEW_GENERATION``: the cache is known to have started anew (a verified reset, a restart the
  monitor saw): generation + 1, seq 0, genesis if proven empty, else unknown.
- ``STEP``: one request's chain step *and* its lineage record, in one call. The record arrives as
  a JSON object without its chain fields; the script appends ``seq``, ``state_before``,
  ``state_after``, ``state_known``, ``stale``, ``unordered`` and ``exact`` (in that order, the
  exact bytes of ``router.ledger.records.with_chain``), adds it to the replica's lineage stream
  and remembers its answer under the request's step key, so a retry (its reply was lost) gets
  the first answer: the chain never steps twice and the record is never written twice. A retry
  after the step key expired still finds the request's record (its key lives for
  ``request_ttl_s``, days) and answers from it, so only a retry later than that can step twice,
  and then as an uncertain step (below), never as a second certain one.
- ``FENCED_STEP``: the eval variant, under the run's turn: it also stores the run's request
  counter; when the caller's fence token no longer holds the turn, the request still touched
  the cache but its order is lost, so the chain moves to a fresh unknown state
  (``unordered: true``).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

# Shared Lua: an unknown fingerprint, and a new generation number for a chain.
_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function unknown_state(tag)
  local t = redis.call('TIME')
  return redis.sha1hex('kvledger/unknown|' .. KEYS[1] .. '|' .. tag .. '|' .. t[1] .. '.' .. t[2])
end
local function next_generation(current)
  if current then return tonumber(current) + 1 end
  return now_ms()
end
local function start(gen, genesis, proven, digest, at, reason, counter)
  local state, known = genesis, '1'
  if proven ~= '1' then state, known = unknown_state('g' .. gen), '0' end
  redis.call('HSET', KEYS[1], 'generation', gen, 'seq', 0, 'state', state, 'known', known,
             'engine_digest', digest, 'since', at, 'reason', reason, 'counter', counter)
  return {tostring(gen), '0', state, digest, known, reason}
end
"""

# KEYS[1] cache. ARGV: engine digest, genesis, now, proven empty ('1'/'0'), request counter.
# Returns generation, seq, state, engine digest, known, reason ('' when nothing changed).
ENSURE_LUA = (
    _COMMON
    + """
local cur = redis.call('HMGET', KEYS[1], 'generation', 'seq', 'state', 'engine_digest', 'known',
                       'counter')
local counter = tonumber(ARGV[5])
if not cur[1] then
  return start(now_ms(), ARGV[2], ARGV[4], ARGV[1], ARGV[3], 'first seen', counter)
end
if cur[4] ~= ARGV[1] then
  return start(next_generation(cur[1]), ARGV[2], ARGV[4], ARGV[1], ARGV[3], 'engine changed',
               counter)
end
if counter < tonumber(cur[6] or '0') then
  return start(next_generation(cur[1]), ARGV[2], ARGV[4], ARGV[1], ARGV[3],
               'request counter below its value when the generation began: restart or reload',
               counter)
end
return {cur[1], cur[2], cur[3], cur[4], cur[5] or '1', ''}
"""
)

# KEYS[1] cache. ARGV: engine digest, genesis, now, reason, proven empty, request counter.
NEW_GENERATION_LUA = (
    _COMMON
    + """
local gen = next_generation(redis.call('HGET', KEYS[1], 'generation'))
return start(gen, ARGV[2], ARGV[5], ARGV[1], ARGV[3], ARGV[4], tonumber(ARGV[6]))
"""
)

# The step proper. KEYS[1] cache, KEYS[2] step key, KEYS[3] the replica's lineage stream,
# KEYS[4] the record's own key (looked up by request id). ARGV[1] generation, [2] request
# digest, [3] record (JSON object without chain fields), [4] step key TTL s, [5] stream maxlen,
# [6] exact ('1'/'0'), [7] request id, [8] record key TTL s. Fenced: KEYS[5] turn, KEYS[6] run
# hash, ARGV[9] token, [10] run id, [11] request counter after the request.
# Returns "ok|stale|unordered GEN SEQ BEFORE AFTER KNOWN", or "nochain".
_STEP = """
local function bool(b) if b then return 'true' else return 'false' end end
local function str(s) if s then return '"' .. s .. '"' else return 'null' end end
local function answer_of(raw)
  local r = cjson.decode(raw)
  local function word(v) if v == nil or v == cjson.null then return '-' end return tostring(v) end
  local status = 'ok'
  if r['stale'] == true then status = 'stale'
  elseif r['unordered'] == true then status = 'unordered' end
  local seq = 'null'
  if r['seq'] ~= nil and r['seq'] ~= cjson.null then seq = string.format('%d', r['seq']) end
  return table.concat({status, string.format('%d', r['generation']), seq, word(r['state_before']),
                       word(r['state_after']), r['state_known'] == true and '1' or '0'}, ' ')
end
local function finish(status, gen, seq, before, after, known, exact)
  local s = 'null'
  if seq then s = tostring(seq) end
  local record = string.sub(ARGV[3], 1, -2) .. ',"seq":' .. s .. ',"state_before":' .. str(before)
    .. ',"state_after":' .. str(after) .. ',"state_known":' .. bool(known)
    .. ',"stale":' .. bool(status == 'stale') .. ',"unordered":' .. bool(status == 'unordered')
    .. ',"exact":' .. bool(exact) .. '}'
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'id', ARGV[7], 'r', record)
  redis.call('SET', KEYS[4], record, 'EX', ARGV[8])
  local answer = table.concat({status, gen, s, before or '-', after or '-',
                               known and '1' or '0'}, ' ')
  redis.call('SET', KEYS[2], answer, 'EX', ARGV[4])
  return answer
end
local done = redis.call('GET', KEYS[2])
if done then return done end
local prior = redis.call('GET', KEYS[4])
if prior then return answer_of(prior) end
local cur = redis.call('HMGET', KEYS[1], 'generation', 'seq', 'state', 'known')
if not cur[1] then return 'nochain' end
local lost = FENCE_LOST
if cur[1] ~= ARGV[1] then
  return finish('stale', cur[1], nil, nil, nil, false, false)
end
local known = cur[4] ~= '0'
local seq = tonumber(cur[2] or '0')  -- this request's; the head moves on by one, in one HSET
local after, status = redis.sha1hex(cur[3] .. '|' .. ARGV[2]), 'ok'
if lost then
  after, status = unknown_state('s' .. seq), 'unordered'
  redis.call('HSET', KEYS[1], 'seq', seq + 1, 'state', after, 'known', '0')
else
  redis.call('HSET', KEYS[1], 'seq', seq + 1, 'state', after)
end
return finish(status, cur[1], seq, cur[3], after, known, ARGV[6] == '1' and not lost)
"""

STEP_LUA = _COMMON + _STEP.replace("FENCE_LOST", "false")

# A step sent long ago without an answer, whose step key may have expired: it may have run, so
# the chain moves to an unknown state and the record says ``unordered`` (it may be a duplicate).
UNCERTAIN_STEP_LUA = _COMMON + _STEP.replace("FENCE_LOST", "true")

FENCED_STEP_LUA = _COMMON + _STEP.replace(
    "local lost = FENCE_LOST",
    """local lost = redis.call('GET', KEYS[5]) ~= ARGV[9]
if not lost then redis.call('HSET', KEYS[6], 'run', ARGV[10], 'count', ARGV[11]) end""",
)


class Scripts:
    """The chain's scripts, bound to one client (EVALSHA, loaded again on NOSCRIPT)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.ensure: AsyncScript = client.register_script(ENSURE_LUA)
        self.new_generation: AsyncScript = client.register_script(NEW_GENERATION_LUA)
        self.step: AsyncScript = client.register_script(STEP_LUA)
        self.fenced_step: AsyncScript = client.register_script(FENCED_STEP_LUA)
        self.uncertain_step: AsyncScript = client.register_script(UNCERTAIN_STEP_LUA)
        self._client = client

    async def load(self) -> None:
        """Load every script into Redis' script cache (on a cluster, on every master)."""
        for script in (
            self.ensure,
            self.new_generation,
            self.step,
            self.fenced_step,
            self.uncertain_step,
        ):
            await self._client.script_load(script.script)
