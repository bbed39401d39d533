"""The Lua scripts behind every multi-key change of a job (used only by :mod:`shared.queue`).

Each script is one atomic step. Redis never rolls a script back, so each one does the
write that may fail first (XADD) and its bookkeeping after. Invariants they keep:

* A terminal job (succeeded, failed, canceled, expired) is never changed again, except by
  an operator re-queueing a dead letter.
* A stream entry is acknowledged only in the step that stores its job's terminal state
  (or finds the job already terminal or gone), and only acknowledged entries are deleted:
  nothing unread is ever trimmed, so the consumer group's lag stays exact.
* Every terminal transition goes through ``ended()``: it sets the record's TTL, counts
  the job in the model's stats (by status, with its latency), and publishes the job id on
  the job-finished channel, which is what ``Prefer: wait`` listens to.
"""

from __future__ import annotations

from shared.jobs import LATENCY_BUCKETS, TERMINAL_STATUSES


def bucket_name(bound: float) -> str:
    """The stats-hash suffix of a histogram bucket, as the scripts write it."""
    return f"{bound:g}"


_TERMINAL = (
    "local terminal = {" + ", ".join(f"['{s}'] = true" for s in sorted(TERMINAL_STATUSES)) + "}"
)
_BUCKETS = "{" + ", ".join(f"{{{b!r}, '{bucket_name(b)}'}}" for b in LATENCY_BUCKETS) + "}"

_PRELUDE = f"""
{_TERMINAL}
local buckets = {_BUCKETS}
-- One observation of a histogram kept in the stats hash (buckets are not cumulative).
local function observe(stats, name, value)
  local bucket = '+Inf'
  for _, b in ipairs(buckets) do
    if value <= b[1] then bucket = b[2]; break end
  end
  redis.call('HINCRBY', stats, name .. ':' .. bucket, 1)
  redis.call('HINCRBYFLOAT', stats, name .. ':sum', value)
end
-- After a job's terminal fields are written: TTL, stats, recent list, notify.
local function ended(job, stats, recent, ttl, channel, id)
  redis.call('EXPIRE', job, ttl)
  local r = redis.call('HMGET', job, 'status', 'created_at', 'completed_at')
  redis.call('HINCRBY', stats, 'finished:' .. r[1], 1)
  local latency = tonumber(r[3]) - tonumber(r[2])
  observe(stats, 'latency', latency)
  redis.call('LPUSH', recent, r[3] .. ' ' .. latency .. ' ' .. r[1])
  redis.call('LTRIM', recent, 0, 999)
  redis.call('PUBLISH', channel, id)
end
"""

# KEYS: stream, job, idempotency key ("" when none), stats.
# ARGV: job id, fingerprint, idempotency ttl, field, value, ...
# Returns {'replay', "job-id fingerprint"} or {'created', entry id}.
SUBMIT = """
if KEYS[3] ~= '' then
  local prior = redis.call('GET', KEYS[3])
  if prior then return {'replay', prior} end
end
local entry = redis.call('XADD', KEYS[1], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
if KEYS[3] ~= '' then
  redis.call('SET', KEYS[3], ARGV[1] .. ' ' .. ARGV[2], 'EX', ARGV[3])
end
redis.call('HINCRBY', KEYS[4], 'submitted', 1)
return {'created', entry}
"""

# KEYS: job, stats, recent. ARGV: now, worker, ttl, channel, job id, expired-error json.
# Returns {} (gone), {status} (ended now or before: don't run), or
# {'running', input, created_at, deadline}.
START = f"""
{_PRELUDE}
local rec = redis.call('HMGET', KEYS[1], 'status', 'input', 'created_at', 'deadline',
                       'cancel_requested')
local status = rec[1]
if not status then return {{}} end
if terminal[status] then return {{status}} end
local now = tonumber(ARGV[1])
local stop = nil
if rec[5] == '1' then
  stop = 'canceled'
elseif rec[4] and tonumber(rec[4]) < now then
  stop = 'expired'
  redis.call('HSET', KEYS[1], 'error', ARGV[6])
end
if stop then
  redis.call('HSET', KEYS[1], 'status', stop, 'completed_at', ARGV[1])
  ended(KEYS[1], KEYS[2], KEYS[3], ARGV[3], ARGV[4], ARGV[5])
  return {{stop}}
end
if status == 'queued' then observe(KEYS[2], 'wait', now - tonumber(rec[3])) end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2])
return {{'running', rec[2], rec[3], rec[4] or ''}}
"""

# KEYS: job, stream, stats, recent. ARGV: group, entry id, ttl, channel, job id, field,
# value, ... Returns 1 if the fields were stored, 0 if the job was gone or already terminal.
FINISH = f"""
{_PRELUDE}
local status = redis.call('HGET', KEYS[1], 'status')
local stored = 0
if status and not terminal[status] and #ARGV >= 6 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 6))
  ended(KEYS[1], KEYS[3], KEYS[4], ARGV[3], ARGV[4], ARGV[5])
  stored = 1
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
return stored
"""

# End a job that is in the given state (cancel a queued job; expire a late one on read).
# KEYS: job, stats, recent. ARGV: expected status, ttl, channel, job id, field, value, ...
# Returns the status the job had ('' if it is gone); fields are written only if it matched.
END_IF = f"""
{_PRELUDE}
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if status == ARGV[1] then
  redis.call('HSET', KEYS[1], unpack(ARGV, 5))
  ended(KEYS[1], KEYS[2], KEYS[3], ARGV[2], ARGV[3], ARGV[4])
end
return status
"""

# Ask the worker running a job to stop it at its next token.
# KEYS: job. Returns the job's status ('' if gone); the flag is set only if it is running.
REQUEST_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if status == 'running' then redis.call('HSET', KEYS[1], 'cancel_requested', '1') end
return status
"""

# Move a poison entry to the dead-letter stream and fail its job.
# KEYS: job, stream, dead, stats, recent. ARGV: group, entry id, job id, deliveries, now,
# ttl, channel, field, value, ... (the job's terminal fields).
DEAD_LETTER = f"""
{_PRELUDE}
redis.call('XADD', KEYS[3], '*', 'job', ARGV[3], 'entry', ARGV[2], 'deliveries', ARGV[4],
           'at', ARGV[5])
local status = redis.call('HGET', KEYS[1], 'status')
if status and not terminal[status] then
  redis.call('HSET', KEYS[1], unpack(ARGV, 8))
  ended(KEYS[1], KEYS[4], KEYS[5], ARGV[6], ARGV[7], ARGV[3])
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
return 1
"""

# Put a dead letter's job back in its model's queue, as new.
# KEYS: dead, stream, job. ARGV: dead entry id, job id.
# Returns the new entry id, or '' if the job's record is gone (the letter is removed).
REQUEUE = """
local entry = ''
if redis.call('EXISTS', KEYS[3]) == 1 then
  entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[2])
  redis.call('HDEL', KEYS[3], 'started_at', 'completed_at', 'error', 'output', 'worker',
             'cancel_requested', 'inference_seconds', 'batch_size')
  redis.call('HSET', KEYS[3], 'status', 'queued')
  redis.call('PERSIST', KEYS[3])
end
redis.call('XDEL', KEYS[1], ARGV[1])
return entry
"""
