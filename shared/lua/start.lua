-- start: mark a job a worker read as running, unless it must not run.
-- KEYS: [1] the job, [2] the model's stats, [3] the model's recent list
-- ARGV: [1] now, [2] worker, [3] result TTL s, [4] job-finished channel, [5] job id,
--       [6] the deadline error (JSON), [7] the model's key base
-- Reply: {'gone'} (no record), {'ended', status} (ended before, or now: canceled, its
--   batch is cancelling, or expired; don't run it), or
--   {'run', input, created_at, deadline or '', stream ('1' or '')}.
-- A streaming job that runs again (its worker died) gets a restart event: its clients drop
-- the text streamed so far, as the new run streams it anew.
-- A job of a cancelling batch is canceled here, so an entry a worker read while the
-- batch's cancel sweep ran is canceled all the same.
local rec = redis.call('HMGET', KEYS[1], 'status', 'input', 'created_at', 'deadline',
                       'cancel_requested', 'batch', 'webhook', 'webhook_events', 'stream')
local status = rec[1]
if not status then return {'gone'} end
if TERMINAL[status] then return {'ended', status} end
local now, base = tonumber(ARGV[1]), ARGV[7]
local batch, batch_status = nil, nil
if rec[6] then
  batch = batch_key(base, rec[6])
  batch_status = redis.call('HGET', batch, 'status')
end
local stop = nil
if rec[5] == '1' or batch_status == BATCH.CANCELLING or batch_status == BATCH.CANCELLED then
  stop = JOB.CANCELED
elseif rec[4] and tonumber(rec[4]) < now then
  stop = JOB.EXPIRED
  redis.call('HSET', KEYS[1], 'error', ARGV[6])
end
if stop then
  redis.call('HSET', KEYS[1], 'status', stop, 'completed_at', ARGV[1])
  ended(KEYS[1], base, KEYS[2], KEYS[3], ARGV[3], ARGV[4], ARGV[5])
  return {'ended', stop}
end
if status == JOB.QUEUED and not batch then observe(KEYS[2], 'wait', now - tonumber(rec[3])) end
if batch_status == BATCH.QUEUED then
  redis.call('HSET', batch, 'status', BATCH.IN_PROGRESS, 'in_progress_at', ARGV[1])
end
if rec[9] == '1' and redis.call('EXISTS', tokens_key(base, ARGV[5])) == 1 then
  redis.call('XADD', tokens_key(base, ARGV[5]), '*', 'type', 'restart')
end
redis.call('HSET', KEYS[1], 'status', JOB.RUNNING, 'started_at', ARGV[1], 'worker', ARGV[2])
if status == JOB.QUEUED and rec[7] and wants(rec[8], EVENT.JOB_STARTED) then
  emit(base, EVENT.JOB_STARTED, ARGV[5], rec[7])
end
return {'run', rec[2], rec[3], rec[4] or '', rec[9] or ''}
