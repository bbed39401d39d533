-- request_cancel: ask the worker running a job to stop it at its next token.
-- KEYS: [1] the job
-- Reply: the job's status ('' if gone); the flag is set only if it is running.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if status == JOB.RUNNING then redis.call('HSET', KEYS[1], 'cancel_requested', '1') end
return status
