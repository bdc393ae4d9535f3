"""The Lua scripts behind the global limits, and the Redis keys they use.

Every decision is one script run, so it is atomic across all workers: Redis runs one script at a time. Time
comes from the Redis server (``TIME``), never from the workers, so machines with skewed clocks still share one
timeline. Scripts return numbers as strings because Redis truncates Lua numbers to integers on the way out.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- requests per minute: an adaptive token bucket that may go into debt ------------------------------------------
#
# State (one hash per endpoint): rate (tokens/s now), tokens (level at time `last`, negative = reserved by
# callers who are sleeping until their turn), last, blocked (nobody goes before this: Retry-After), changed (time
# of the last rate change), epoch (bumped when reservations are cancelled by a 429), and counters.
#
# acquire: reserve one token and return how long the caller must sleep, plus the epoch. A caller that sleeps
#          re-reads the epoch when it wakes; if a 429 bumped it meanwhile, its reservation was cancelled and it
#          asks again, so a backoff slows down callers that were already waiting too.
# backoff: a 429. Cut the rate by backoff_factor (floored at min_rpm), at most once per token interval (a flood of
#          429s from requests already in flight is one signal); honour Retry-After by moving `blocked`; cancel
#          outstanding reservations.
# recover: a success. Raise the rate by recovery_factor (capped at rpm), at most once per token interval.
# peek:    read the state (for metrics and tests).
#
# ARGV: op, rpm, max_tokens, min_rpm, recovery_factor, backoff_factor, idle_ttl_ms, retry_after_s
RATE_SCRIPT = """
local key = KEYS[1]
local op = ARGV[1]
local max_rate = tonumber(ARGV[2]) / 60.0
local max_tokens = tonumber(ARGV[3])
local min_rate = math.min(tonumber(ARGV[4]) / 60.0, max_rate)
local recovery = tonumber(ARGV[5])
local backoff = tonumber(ARGV[6])
local ttl_ms = tonumber(ARGV[7])
local retry_after = tonumber(ARGV[8])

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000.0

local s = redis.call('HMGET', key, 'rate', 'tokens', 'last', 'blocked', 'changed', 'epoch',
                     'acquires', 'hits', 'backoffs', 'recoveries')
local rate = tonumber(s[1]) or max_rate
-- the configured limits may have changed since the state was written: stay inside them
rate = math.max(math.min(rate, max_rate), min_rate)
local tokens = tonumber(s[2]) or 1.0
local last = tonumber(s[3]) or now
local blocked = tonumber(s[4]) or 0.0
local changed = tonumber(s[5]) or 0.0
local epoch = tonumber(s[6]) or 0
local acquires = tonumber(s[7]) or 0
local hits = tonumber(s[8]) or 0
local backoffs = tonumber(s[9]) or 0
local recoveries = tonumber(s[10]) or 0

local function refill(at)
  if at > last then
    tokens = math.min(max_tokens, tokens + (at - last) * rate)
    last = at
  end
end

local function save()
  redis.call('HSET', key, 'rate', string.format('%.17g', rate), 'tokens', string.format('%.17g', tokens),
             'last', string.format('%.6f', last), 'blocked', string.format('%.6f', blocked),
             'changed', string.format('%.6f', changed), 'epoch', epoch, 'acquires', acquires, 'hits', hits,
             'backoffs', backoffs, 'recoveries', recoveries)
  redis.call('PEXPIRE', key, ttl_ms)
end

if op == 'acquire' then
  refill(math.max(now, blocked))
  tokens = tokens - 1.0
  local go = last
  if tokens < 0 then
    go = last - tokens / rate
  end
  acquires = acquires + 1
  save()
  return {string.format('%.6f', math.max(0.0, go - now)), tostring(epoch)}
elseif op == 'backoff' then
  refill(now)
  hits = hits + 1
  local cancel = false
  if retry_after > 0 and now + retry_after > blocked then
    blocked = now + retry_after
    cancel = true
  end
  if now - changed >= 1.0 / rate then
    rate = math.max(min_rate, rate * backoff)
    changed = now
    backoffs = backoffs + 1
    cancel = true
    tokens = math.min(tokens, 0.0)  -- the next request waits a full interval at the new rate
  end
  if cancel then
    -- sleeping callers re-ask (their reservations are the debt), starting from the level at `now`
    epoch = epoch + 1
    tokens = math.max(tokens, 0.0)
    if last > now then
      tokens = 0.0
    end
    last = now
  end
  save()
  return {string.format('%.6f', rate * 60.0), tostring(epoch)}
elseif op == 'recover' then
  if rate < max_rate and now - changed >= 1.0 / rate then
    refill(now)
    rate = math.min(max_rate, rate * recovery)
    changed = now
    recoveries = recoveries + 1
    save()
  end
  return {string.format('%.6f', rate * 60.0), tostring(epoch)}
end
-- peek
refill(now)
return {string.format('%.6f', rate * 60.0), string.format('%.6f', tokens),
        string.format('%.6f', math.max(0.0, blocked - now)), tostring(epoch), tostring(acquires),
        tostring(hits), tostring(backoffs), tostring(recoveries)}
"""

# --- max concurrency: leased slots in a sorted set (member = lease id, score = expiry in ms) ---------------------
#
# A worker that dies stops renewing, its lease's score falls into the past, and the next acquire drops it. A
# release publishes on a channel so that waiters wake at once instead of polling.
#
# ARGV: op, max_slots, ttl_ms, lease_id, channel
SLOT_SCRIPT = """
local key = KEYS[1]
local op = ARGV[1]
local max_slots = tonumber(ARGV[2])
local ttl_ms = tonumber(ARGV[3])
local lease = ARGV[4]

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function keep_key_alive()
  -- the key outlives its longest lease, never less
  if redis.call('PTTL', key) < ttl_ms then
    redis.call('PEXPIRE', key, ttl_ms)
  end
end

if op == 'acquire' then
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
  local held = redis.call('ZCARD', key)
  if held < max_slots then
    redis.call('ZADD', key, now_ms + ttl_ms, lease)
    keep_key_alive()
    return {1, held + 1}
  end
  -- full: tell the caller when the first lease would expire, so it never sleeps past that
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  return {0, tonumber(first[2]) - now_ms}
elseif op == 'renew' then
  local score = redis.call('ZSCORE', key, lease)
  if (not score) or tonumber(score) <= now_ms then
    return {0, 0}  -- lost: it expired (the holder stalled) and may have been handed to someone else
  end
  redis.call('ZADD', key, now_ms + ttl_ms, lease)
  keep_key_alive()
  return {1, 0}
elseif op == 'release' then
  local removed = redis.call('ZREM', key, lease)
  redis.call('PUBLISH', ARGV[5], lease)
  return {removed, 0}
end
-- count
redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
return {redis.call('ZCARD', key), 0}
"""


@dataclass(frozen=True, slots=True)
class LimitKeys:
    """The Redis names one endpoint's limits live under: ``{prefix}:limit:{endpoint}:...``."""

    prefix: str
    endpoint: str

    @property
    def rate(self) -> str:
        return f"{self.prefix}:limit:{self.endpoint}:rate"

    @property
    def slots(self) -> str:
        return f"{self.prefix}:limit:{self.endpoint}:slots"

    @property
    def released(self) -> str:
        """Pub/sub channel announcing freed slots."""
        return f"{self.prefix}:limit:{self.endpoint}:released"

    def all(self) -> list[str]:
        return [self.rate, self.slots]
