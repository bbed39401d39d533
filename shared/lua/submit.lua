-- submit: queue one job: its entry and its record in one step.
-- KEYS: [1] the lane's stream, [2] the job, [3] the model's stats,
--       [4] the Idempotency-Key's key (only when the request has one)
-- ARGV: [1] job id, [2] request fingerprint, [3] idempotency TTL s, [4..] field, value, ...
-- Reply: {'replay', "job-id fingerprint"} when the Idempotency-Key was used before (nothing
--   is written), else {'created', entry id}.
-- The XADD, the write that may fail, comes first: Redis never rolls a script back.
if KEYS[4] then
  local prior = redis.call('GET', KEYS[4])
  if prior then return {'replay', prior} end
end
local entry = redis.call('XADD', KEYS[1], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
if KEYS[4] then
  redis.call('SET', KEYS[4], ARGV[1] .. ' ' .. ARGV[2], 'EX', ARGV[3])
end
redis.call('HINCRBY', KEYS[3], 'submitted', 1)
return {'created', entry}
