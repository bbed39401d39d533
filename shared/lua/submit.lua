-- submit: create one job: queued (its entry and its record in one step), or, when it is
-- cacheable, answered from the cache or following an identical job already queued or
-- running (lib.lua: lookup).
-- KEYS: [1] the lane's stream, [2] the job, [3] the model's stats,
--       [4] the Idempotency-Key's key (only when the request has one)
-- ARGV: [1] job id, [2] request fingerprint, [3] idempotency TTL s, [4] the model's key
--       base, [5] cache fingerprint ('' : not cacheable), [6] now, [7] result TTL s,
--       [8] job-finished channel, [9] API key id ('' : none), [10] the key's cap on
--       unfinished jobs (0 : none), [11..] field, value, ...
-- Reply: {'replay', "job-id fingerprint"} when the Idempotency-Key was used before (nothing
--   is written), {'full', unfinished} when the key has its cap of unfinished jobs (nothing
--   is written), else {'created', entry id}, or {'hit', record} (the job succeeded
--   already) or {'follow', record} (it follows an identical job), record being the job's
--   hash as HGETALL gives it, so the gateway need not read it back.
-- The XADD, the write that may fail, comes first: Redis never rolls a script back.
if KEYS[4] then
  local prior = redis.call('GET', KEYS[4])
  if prior then return {'replay', prior} end
end
local base, fp = ARGV[4], ARGV[5]
local owner, cap = ARGV[9], tonumber(ARGV[10])
if cap > 0 and not below_cap(base, owner, cap) then
  return {'full', redis.call('SCARD', active_key(base, owner))}
end
local outcome, value = 'lead', nil
if fp ~= '' then outcome, value = lookup(base, fp) end
local entry = nil
if outcome == 'lead' then entry = redis.call('XADD', KEYS[1], '*', 'job', ARGV[1]) end
redis.call('HSET', KEYS[2], unpack(ARGV, 11))
if cap > 0 then redis.call('SADD', active_key(base, owner), ARGV[1]) end
local listed = jobs_of_key(base, owner)  -- its key's recent jobs (GET /v1/jobs)
redis.call('ZADD', listed, ARGV[6], ARGV[1])
redis.call('ZREMRANGEBYRANK', listed, 0, -RECENT_JOBS_KEPT - 1)
redis.call('EXPIRE', listed, ARGV[7])
if KEYS[4] then
  redis.call('SET', KEYS[4], ARGV[1] .. ' ' .. ARGV[2], 'EX', ARGV[3])
end
redis.call('HINCRBY', KEYS[3], 'submitted', 1)
if fp ~= '' then apply_lookup(base, KEYS[2], ARGV[1], fp, outcome, value, ARGV[6], ARGV[7], ARGV[8]) end
if outcome ~= 'lead' then return {outcome, redis.call('HGETALL', KEYS[2])} end
return {'created', entry}
