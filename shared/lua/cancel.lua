-- cancel: a client cancels its job. A queued job ends canceled now; a running one is asked
-- to stop at its next token (its worker ends it). A job that follows another, or that
-- others follow, ends canceled now, and the work goes on for the others (lib.lua).
-- KEYS: [1] the job, [2] the model's stats, [3] the model's recent list
-- ARGV: [1] result TTL s, [2] job-finished channel, [3] job id, [4] the model's key base,
--       [5..] field, value, ... (the terminal fields)
-- Reply: the job's status before ('' if it is gone); a terminal job is unchanged.
local status = redis.call('HGET', KEYS[1], 'status')
if not status or TERMINAL[status] then return status or '' end
local base, id = ARGV[4], ARGV[3]
local r = redis.call('HMGET', KEYS[1], 'follows', 'cache_fp')
local followed = r[2] and redis.call('LLEN', followers_key(base, id)) > 0
if status == JOB.QUEUED or r[1] or followed then
  redis.call('HSET', KEYS[1], unpack(ARGV, 5))
  ended(KEYS[1], base, KEYS[2], KEYS[3], ARGV[1], ARGV[2], id)
  unfollow(base, KEYS[1], id)
else
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
end
left(base, KEYS[1], id)
return status
