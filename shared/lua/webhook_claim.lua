-- webhook_claim: claim one attempt of a delivery, so a Celery message delivered twice
-- never makes two requests for the same attempt.
-- KEYS: [1] the delivery
-- ARGV: [1] attempt number, [2] now, [3] lease s
-- Reply: {url, payload, created_at} when this attempt may run now, else nil: the delivery
--   ended, the attempt was already made, or another copy claimed it less than a lease ago.
local rec = KEYS[1]
local attempt, now, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('HGET', rec, 'state') ~= DELIVERY.PENDING then return nil end
if tonumber(redis.call('HGET', rec, 'attempts') or '0') ~= attempt - 1 then return nil end
local claimed = tonumber(redis.call('HGET', rec, 'claimed') or '0')
local claimed_at = tonumber(redis.call('HGET', rec, 'claimed_at') or '0')
if claimed == attempt and claimed_at > now - lease then return nil end
redis.call('HSET', rec, 'claimed', attempt, 'claimed_at', ARGV[2])
return redis.call('HMGET', rec, 'url', 'payload', 'created_at')
