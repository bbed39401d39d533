-- requeue: put a dead letter's job back in its lane, as new. A request of a batch is taken
-- out of its batch's counts and results again, and a completed batch is reopened (it
-- completes, and says so, once more when the request ends).
-- KEYS: [1] the model's dead letters, [2] the lane's stream, [3] the job
-- ARGV: [1] dead entry id, [2] job id, [3] the model's key base
-- Reply: the new entry id, or '' if the job's record is gone (the letter is removed).
local function reopen(base, batch_id, status, id)
  local batch, results = batch_key(base, batch_id), batch_results_key(base, batch_id)
  if redis.call('EXISTS', batch) == 0 then return end
  redis.call('HINCRBY', batch, BATCH_COUNTER[status], -1)
  local mark = '"job_id":"' .. id .. '"'
  for _, line in ipairs(redis.call('LRANGE', results, 0, -1)) do
    if string.find(line, mark, 1, true) then
      redis.call('LREM', results, 1, line)
      break
    end
  end
  if redis.call('HGET', batch, 'status') == BATCH.COMPLETED then
    redis.call('HSET', batch, 'status', BATCH.IN_PROGRESS)
    redis.call('HDEL', batch, 'completed_at')
    redis.call('PERSIST', batch)
    redis.call('PERSIST', results)
    redis.call('PERSIST', batch_jobs_key(base, batch_id))
  end
end
local entry = ''
if redis.call('EXISTS', KEYS[3]) == 1 then
  local r = redis.call('HMGET', KEYS[3], 'status', 'batch')
  if r[2] and TERMINAL[r[1]] then reopen(ARGV[3], r[2], r[1], ARGV[2]) end
  entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[2])
  redis.call('HDEL', KEYS[3], 'started_at', 'completed_at', 'error', 'output', 'worker',
             'cancel_requested', 'inference_seconds', 'batch_size')
  redis.call('HSET', KEYS[3], 'status', JOB.QUEUED)
  redis.call('PERSIST', KEYS[3])
end
redis.call('XDEL', KEYS[1], ARGV[1])
return entry
