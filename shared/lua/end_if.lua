-- end_if: end a job that is in the expected state (expire a late one when it is read; a
-- batch's cancel sweep).
-- KEYS: [1] the job, [2] the model's stats, [3] the model's recent list
-- ARGV: [1] expected status, [2] result TTL s, [3] job-finished channel, [4] job id,
--       [5] the model's key base, [6..] field, value, ... (the terminal fields)
-- Reply: the status the job had ('' if it is gone); the fields are written only if it
--   was the expected one. A job that followed another leaves it; one that others follow
--   goes on for them (lib.lua: unfollow, left).
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if status == ARGV[1] then
  redis.call('HSET', KEYS[1], unpack(ARGV, 6))
  ended(KEYS[1], ARGV[5], KEYS[2], KEYS[3], ARGV[2], ARGV[3], ARGV[4])
  unfollow(ARGV[5], KEYS[1], ARGV[4])
  left(ARGV[5], KEYS[1], ARGV[4])
end
return status
