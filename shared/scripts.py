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
* A job of a batch also carries its batch's key names; ``ended()`` counts it in the batch,
  appends its result line, and ends the batch when the last request ends. Batch jobs are
  counted apart (``batch:*`` stats) so they never skew interactive latency.
* Webhook events are written to the events stream (an outbox) by the same script as the
  transition they announce, so an event is never lost nor sent for a change that did not
  happen; the webhook worker turns each into a delivery.
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
-- Is event type etype in a space-separated list of wanted events?
local function wants(list, etype)
  return list and string.find(' ' .. list .. ' ', ' ' .. etype .. ' ', 1, true) ~= nil
end
-- Queue a webhook event (the outbox); the webhook worker builds and sends the payload.
local function emit(events, etype, id, url)
  redis.call('XADD', events, '*', 'type', etype, 'id', id, 'url', url)
end
local job_event = {{succeeded = 'job.completed', failed = 'job.failed',
                   expired = 'job.failed', canceled = 'job.canceled'}}
local batch_counter = {{succeeded = 'completed', failed = 'failed', expired = 'failed',
                       canceled = 'cancelled'}}
-- A request of a batch ended: count it, keep its result line, end the batch if it was
-- the last one.
local function batch_request_ended(batch, results, status, id, custom_id, output, err,
                                   now, ttl)
  if redis.call('EXISTS', batch) == 0 then return end  -- expired long ago
  redis.call('HINCRBY', batch, batch_counter[status], 1)
  redis.call('RPUSH', results, '{{"custom_id":' .. cjson.encode(custom_id) .. ',"job_id":"'
    .. id .. '","status":"' .. status .. '","output":' .. (output or 'null')
    .. ',"error":' .. (err or 'null') .. '}}')
  local b = redis.call('HMGET', batch, 'total', 'completed', 'failed', 'cancelled', 'status',
                       'id', 'webhook', 'webhook_events', 'events_key', 'jobs_key')
  local done = tonumber(b[2]) + tonumber(b[3]) + tonumber(b[4])
  if done < tonumber(b[1]) or b[5] == 'completed' or b[5] == 'cancelled' then return end
  local final = 'completed'
  if b[5] == 'cancelling' then final = 'cancelled' end
  redis.call('HSET', batch, 'status', final, final .. '_at', now)
  redis.call('EXPIRE', batch, ttl)
  redis.call('EXPIRE', results, ttl)
  redis.call('EXPIRE', b[10], ttl)
  if b[7] and wants(b[8], 'batch.' .. final) then emit(b[9], 'batch.' .. final, b[6], b[7]) end
end
-- After a job's terminal fields are written: TTL, stats, recent list, notify, events.
local function ended(job, stats, recent, ttl, channel, id)
  redis.call('EXPIRE', job, ttl)
  local r = redis.call('HMGET', job, 'status', 'created_at', 'completed_at', 'batch_key',
                       'results_key', 'custom_id', 'output', 'error', 'webhook',
                       'webhook_events', 'events_key')
  local status = r[1]
  if r[4] then
    redis.call('HINCRBY', stats, 'batch:finished:' .. status, 1)
    batch_request_ended(r[4], r[5], status, id, r[6], r[7], r[8], r[3], ttl)
  else
    redis.call('HINCRBY', stats, 'finished:' .. status, 1)
    local latency = tonumber(r[3]) - tonumber(r[2])
    observe(stats, 'latency', latency)
    redis.call('LPUSH', recent, r[3] .. ' ' .. latency .. ' ' .. status)
    redis.call('LTRIM', recent, 0, 999)
  end
  if r[9] and wants(r[10], job_event[status]) then emit(r[11], job_event[status], id, r[9]) end
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
                       'cancel_requested', 'batch_key', 'webhook', 'webhook_events',
                       'events_key')
local status = rec[1]
if not status then return {{}} end
if terminal[status] then return {{status}} end
local now = tonumber(ARGV[1])
local batch_status = nil
if rec[6] then batch_status = redis.call('HGET', rec[6], 'status') end
local stop = nil
if rec[5] == '1' or batch_status == 'cancelling' or batch_status == 'cancelled' then
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
if status == 'queued' and not rec[6] then observe(KEYS[2], 'wait', now - tonumber(rec[3])) end
if batch_status == 'queued' then
  redis.call('HSET', rec[6], 'status', 'in_progress', 'in_progress_at', ARGV[1])
end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2])
if status == 'queued' and rec[7] and wants(rec[8], 'job.started') then
  emit(rec[9], 'job.started', ARGV[5], rec[7])
end
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
# ttl, channel, lane, field, value, ... (the job's terminal fields).
DEAD_LETTER = f"""
{_PRELUDE}
redis.call('XADD', KEYS[3], '*', 'job', ARGV[3], 'entry', ARGV[2], 'deliveries', ARGV[4],
           'at', ARGV[5], 'lane', ARGV[8])
local status = redis.call('HGET', KEYS[1], 'status')
if status and not terminal[status] then
  redis.call('HSET', KEYS[1], unpack(ARGV, 9))
  ended(KEYS[1], KEYS[4], KEYS[5], ARGV[6], ARGV[7], ARGV[3])
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
return 1
"""

# Put a dead letter's job back in its model's queue, as new. A request of a batch is
# taken out of its batch's counts and results again, and a completed batch is reopened
# (it completes, and says so, once more when the request ends).
# KEYS: dead, stream, job. ARGV: dead entry id, job id.
# Returns the new entry id, or '' if the job's record is gone (the letter is removed).
REQUEUE = f"""
{_PRELUDE}
local function reopen(batch, results, status, id)
  if redis.call('EXISTS', batch) == 0 then return end
  redis.call('HINCRBY', batch, batch_counter[status], -1)
  local mark = '"job_id":"' .. id .. '"'
  for _, line in ipairs(redis.call('LRANGE', results, 0, -1)) do
    if string.find(line, mark, 1, true) then
      redis.call('LREM', results, 1, line)
      break
    end
  end
  if redis.call('HGET', batch, 'status') == 'completed' then
    redis.call('HSET', batch, 'status', 'in_progress')
    redis.call('HDEL', batch, 'completed_at')
    redis.call('PERSIST', batch)
    redis.call('PERSIST', results)
    redis.call('PERSIST', redis.call('HGET', batch, 'jobs_key'))
  end
end
local entry = ''
if redis.call('EXISTS', KEYS[3]) == 1 then
  local r = redis.call('HMGET', KEYS[3], 'status', 'batch_key', 'results_key')
  if r[2] and terminal[r[1]] then reopen(r[2], r[3], r[1], ARGV[2]) end
  entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[2])
  redis.call('HDEL', KEYS[3], 'started_at', 'completed_at', 'error', 'output', 'worker',
             'cancel_requested', 'inference_seconds', 'batch_size')
  redis.call('HSET', KEYS[3], 'status', 'queued')
  redis.call('PERSIST', KEYS[3])
end
redis.call('XDEL', KEYS[1], ARGV[1])
return entry
"""

# Make a batch visible and queue its requests, in one step: the job records were written
# before (with a short TTL, so a gateway dying midway leaves nothing behind); this queues
# them all or none. KEYS: batch stream, batch, batch jobs, idempotency key ("" when none),
# stats. ARGV: batch id, fingerprint, idempotency ttl, job key prefix, n, n job ids, then
# the batch's field, value, ... Returns {'replay', "batch-id fingerprint"} or {'created'}.
COMMIT_BATCH = """
if KEYS[4] ~= '' then
  local prior = redis.call('GET', KEYS[4])
  if prior then return {'replay', prior} end
end
local n = tonumber(ARGV[5])
for i = 6, 5 + n do
  redis.call('XADD', KEYS[1], '*', 'job', ARGV[i])
  redis.call('PERSIST', ARGV[4] .. ARGV[i])
end
for i = 6, 5 + n, 1000 do
  redis.call('RPUSH', KEYS[3], unpack(ARGV, i, math.min(i + 999, 5 + n)))
end
redis.call('HSET', KEYS[2], unpack(ARGV, 6 + n))
if KEYS[4] ~= '' then
  redis.call('SET', KEYS[4], ARGV[1] .. ' ' .. ARGV[2], 'EX', ARGV[3])
end
redis.call('HINCRBY', KEYS[5], 'batch:submitted', n)
return {'created'}
"""

# Start cancelling a batch: from now on its requests end canceled instead of starting.
# KEYS: batch. ARGV: now. Returns the batch's status before ('' if gone).
CANCEL_BATCH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if status == 'queued' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
end
return status
"""
