-- cancel_batch: start cancelling a batch; from now on its requests end canceled instead of
-- starting (start.lua checks), and its last running request ends it cancelled.
-- KEYS: [1] the batch
-- ARGV: [1] now
-- Reply: the batch's status before ('' if gone).
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if status == BATCH.QUEUED or status == BATCH.IN_PROGRESS then
  redis.call('HSET', KEYS[1], 'status', BATCH.CANCELLING, 'cancelling_at', ARGV[1])
end
return status
