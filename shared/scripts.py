"""The Lua scripts behind every multi-key change of a job (used only by :mod:`shared.queue`).

Each script is one atomic step. Redis never rolls a script back, so each one does the
write that may fail first (XADD) and its bookkeeping after. Invariants they keep:

* A terminal job (succeeded, failed, canceled, expired) is never changed again, except by
  an operator re-queueing a dead letter.
* A stream entry is acknowledged only in the step that stores its job's terminal state
  (or finds the job already terminal or gone), and only acknowledged entries are deleted:
  nothing unread is ever trimmed, so the consumer group's lag stays exact.
* Every terminal transition sets the record's TTL and publishes the job id on the
  job-finished channel, which is what ``Prefer: wait`` listens to.
"""

from __future__ import annotations

from shared.jobs import TERMINAL_STATUSES

_TERMINAL = (
    "local terminal = {" + ", ".join(f"['{s}'] = true" for s in sorted(TERMINAL_STATUSES)) + "}"
)

# KEYS: stream, job, idempotency key ("" when none).
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
return {'created', entry}
"""

# KEYS: job. ARGV: now, worker, ttl, channel, job id, expired-error json.
# Returns {} (gone), {status} (ended now or before: don't run), or
# {'running', input, created_at, deadline}.
START = f"""
{_TERMINAL}
local rec = redis.call('HMGET', KEYS[1], 'status', 'input', 'created_at', 'deadline',
                       'cancel_requested')
local status = rec[1]
if not status then return {{}} end
if terminal[status] then return {{status}} end
local ended = nil
if rec[5] == '1' then
  ended = 'canceled'
elseif rec[4] and tonumber(rec[4]) < tonumber(ARGV[1]) then
  ended = 'expired'
  redis.call('HSET', KEYS[1], 'error', ARGV[6])
end
if ended then
  redis.call('HSET', KEYS[1], 'status', ended, 'completed_at', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  return {{ended}}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2])
return {{'running', rec[2], rec[3], rec[4] or ''}}
"""

# KEYS: job, stream. ARGV: group, entry id, ttl, channel, job id, field, value, ...
# Returns 1 if the fields were stored, 0 if the job was gone or already terminal.
FINISH = f"""
{_TERMINAL}
local status = redis.call('HGET', KEYS[1], 'status')
local stored = 0
if status and not terminal[status] and #ARGV >= 6 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 6))
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  stored = 1
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
return stored
"""

# End a job that is in the given state (cancel a queued job; expire a late one on read).
# KEYS: job. ARGV: expected status, ttl, channel, job id, field, value, ...
# Returns the status the job had ('' if it is gone); fields are written only if it matched.
END_IF = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if status == ARGV[1] then
  redis.call('HSET', KEYS[1], unpack(ARGV, 5))
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('PUBLISH', ARGV[3], ARGV[4])
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
# KEYS: job, stream, dead. ARGV: group, entry id, job id, deliveries, now, ttl, channel,
# field, value, ... (the job's terminal fields).
DEAD_LETTER = f"""
{_TERMINAL}
redis.call('XADD', KEYS[3], '*', 'job', ARGV[3], 'entry', ARGV[2], 'deliveries', ARGV[4],
           'at', ARGV[5])
local status = redis.call('HGET', KEYS[1], 'status')
if status and not terminal[status] then
  redis.call('HSET', KEYS[1], unpack(ARGV, 8))
  redis.call('EXPIRE', KEYS[1], ARGV[6])
  redis.call('PUBLISH', ARGV[7], ARGV[3])
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
