-- commit_batch: make a batch visible and queue all its requests, in one step. The job
-- records were written before with a short TTL, so a gateway dying midway leaves nothing
-- behind; this queues them all or none.
-- KEYS: [1] the model's batch stream, [2] the batch, [3] the batch's job list,
--       [4] the model's stats, [5] the Idempotency-Key's key (only when given)
-- ARGV: [1] batch id, [2] request fingerprint, [3] idempotency TTL s,
--       [4] the model's key base, [5] n, [6 .. 5+n] the job ids, then field, value, ...
--       of the batch record
-- Reply: {'replay', "batch-id fingerprint"} (nothing written), or {'created'}.
if KEYS[5] then
  local prior = redis.call('GET', KEYS[5])
  if prior then return {'replay', prior} end
end
local n = tonumber(ARGV[5])
for i = 6, 5 + n do
  redis.call('XADD', KEYS[1], '*', 'job', ARGV[i])
  redis.call('PERSIST', job_key(ARGV[4], ARGV[i]))
end
for i = 6, 5 + n, 1000 do
  redis.call('RPUSH', KEYS[3], unpack(ARGV, i, math.min(i + 999, 5 + n)))
end
redis.call('HSET', KEYS[2], unpack(ARGV, 6 + n))
if KEYS[5] then
  redis.call('SET', KEYS[5], ARGV[1] .. ' ' .. ARGV[2], 'EX', ARGV[3])
end
redis.call('HINCRBY', KEYS[4], 'batch:submitted', n)
return {'created'}
