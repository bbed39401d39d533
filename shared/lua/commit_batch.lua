-- commit_batch: make a batch visible and queue all its requests, in one step. The job
-- records were written before with a short TTL, so a gateway dying midway leaves nothing
-- behind; this queues them all or none. A cacheable request (its record has cache_fp) is
-- answered from the cache, follows an identical job (of this batch or not), or leads
-- (lib.lua: lookup): a batch whose lines repeat computes each distinct one once.
-- KEYS: [1] the model's batch stream, [2] the batch, [3] the batch's job list,
--       [4] the model's stats, [5] the Idempotency-Key's key (only when given)
-- ARGV: [1] batch id, [2] request fingerprint, [3] idempotency TTL s,
--       [4] the model's key base, [5] now, [6] result TTL s, [7] job-finished channel,
--       [8] n, [9 .. 8+n] the job ids, then field, value, ... of the batch record
-- Reply: {'replay', "batch-id fingerprint"} (nothing written), or {'created'}.
if KEYS[5] then
  local prior = redis.call('GET', KEYS[5])
  if prior then return {'replay', prior} end
end
local base, n = ARGV[4], tonumber(ARGV[8])
redis.call('HSET', KEYS[2], unpack(ARGV, 9 + n))
for i = 9, 8 + n, 1000 do
  redis.call('RPUSH', KEYS[3], unpack(ARGV, i, math.min(i + 999, 8 + n)))
end
redis.call('HINCRBY', KEYS[4], 'batch:submitted', n)
if KEYS[5] then
  redis.call('SET', KEYS[5], ARGV[1] .. ' ' .. ARGV[2], 'EX', ARGV[3])
end
for i = 9, 8 + n do
  local job = job_key(base, ARGV[i])
  redis.call('PERSIST', job)
  local fp = redis.call('HGET', job, 'cache_fp')
  local leads = true
  if fp then
    local outcome, value = lookup(base, fp)
    leads = apply_lookup(base, job, ARGV[i], fp, outcome, value, ARGV[5], ARGV[6], ARGV[7])
  end
  if leads then redis.call('XADD', KEYS[1], '*', 'job', ARGV[i]) end
end
return {'created'}
