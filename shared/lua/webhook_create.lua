-- webhook_create: store a webhook delivery once, listed under its job or batch.
-- KEYS: [1] the delivery, [2] its owner's delivery list (only when it has an owner)
-- ARGV: [1] TTL s, [2..] field, value, ...
-- Reply: 'created', or 'exists' (an event processed twice is delivered once).
if redis.call('EXISTS', KEYS[1]) == 1 then return 'exists' end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
if KEYS[2] then
  redis.call('RPUSH', KEYS[2], redis.call('HGET', KEYS[1], 'id'))
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return 'created'
