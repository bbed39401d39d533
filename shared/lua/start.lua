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
-- A job that others follow (lib.lua) runs for them even when it ended for its own client;
-- they are marked running with it, and no deadline stops it.
local rec = redis.call('HMGET', KEYS[1], 'status', 'input', 'created_at', 'deadline',
                       'cancel_requested', 'batch', 'webhook', 'webhook_events', 'stream',
                       'cache_fp')
local status = rec[1]
if not status then return {'gone'} end
local now, base, id = tonumber(ARGV[1]), ARGV[7], ARGV[5]
local followed = rec[10] and redis.call('LLEN', followers_key(base, id)) > 0
if TERMINAL[status] and not followed then return {'ended', status} end
local batch, batch_status = nil, nil
if rec[6] then
  batch = batch_key(base, rec[6])
  batch_status = redis.call('HGET', batch, 'status')
end
if not TERMINAL[status] then
  local stop = nil
  if rec[5] == '1' or batch_status == BATCH.CANCELLING or batch_status == BATCH.CANCELLED then
    stop = JOB.CANCELED
  elseif rec[4] and tonumber(rec[4]) < now then
    stop = JOB.EXPIRED
    redis.call('HSET', KEYS[1], 'error', ARGV[6])
  end
  if stop then
    redis.call('HSET', KEYS[1], 'status', stop, 'completed_at', ARGV[1])
    ended(KEYS[1], base, KEYS[2], KEYS[3], ARGV[3], ARGV[4], id)
    if not left(base, KEYS[1], id) then return {'ended', stop} end
    status = stop
  end
end
if not TERMINAL[status] then
  if status == JOB.QUEUED and not batch then observe(KEYS[2], 'wait', now - tonumber(rec[3])) end
  if batch_status == BATCH.QUEUED then
    redis.call('HSET', batch, 'status', BATCH.IN_PROGRESS, 'in_progress_at', ARGV[1])
  end
  if rec[9] == '1' and redis.call('EXISTS', tokens_key(base, id)) == 1 then
    redis.call('XADD', tokens_key(base, id), '*', 'type', 'restart')
  end
  if status == JOB.QUEUED then
    mark_running(base, KEYS[1], id, ARGV[1], ARGV[2])
  else
    redis.call('HSET', KEYS[1], 'started_at', ARGV[1], 'worker', ARGV[2])
  end
end
local deadline, stream = rec[4] or '', rec[9] or ''
if followed then
  for _, f in ipairs(redis.call('LRANGE', followers_key(base, id), 0, -1)) do
    local follower = job_key(base, f)
    if redis.call('HGET', follower, 'status') == JOB.QUEUED then
      mark_running(base, follower, f, ARGV[1], ARGV[2])
    end
  end
  deadline = ''
end
if TERMINAL[status] then stream = '' end
return {'run', rec[2], rec[3], deadline, stream}
