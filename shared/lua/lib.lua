-- lib.lua: what every script shares. shared/scripts.py loads each script as
--   #!lua (no flags: in a Redis Cluster every key must hash to the slot of its KEYS)
--   the constants of shared/states.py and shared/stats.py (JOB, TERMINAL, BATCH, EVENT,
--     EVENT_OF_END, BATCH_COUNTER, EVENT_OF_BATCH_END, BUCKETS), generated from the enums
--   this file
--   the script itself
-- so no status, event name or bucket is ever written here as a literal.
--
-- Keys: scripts get the keys they know in KEYS. The keys of a job's batch and the model's
-- events outbox are derived here from the model's base ``P:{m}:`` (shared.keys.Keys.base,
-- passed in ARGV); they share the model's hash tag with every key in KEYS. These names
-- mirror shared.keys.Keys; tests/test_scripts.py checks both agree.

local function job_key(base, id) return base .. 'job:' .. id end
local function batch_key(base, id) return base .. 'batch:' .. id end
local function batch_jobs_key(base, id) return base .. 'batch-jobs:' .. id end
local function batch_results_key(base, id) return base .. 'batch-results:' .. id end
local function tokens_key(base, id) return base .. 'tokens:' .. id end
local function events_key(base) return base .. 'events' end

-- One observation of a histogram kept in the stats hash (buckets are not cumulative).
local function observe(stats, name, value)
  local bucket = '+Inf'
  for _, b in ipairs(BUCKETS) do
    if value <= b[1] then bucket = b[2]; break end
  end
  redis.call('HINCRBY', stats, name .. ':' .. bucket, 1)
  redis.call('HINCRBYFLOAT', stats, name .. ':sum', value)
end

-- Is event type etype in a space-separated list of wanted events?
local function wants(list, etype)
  return list and string.find(' ' .. list .. ' ', ' ' .. etype .. ' ', 1, true) ~= nil
end

-- Queue a webhook event in the outbox; the webhook worker builds and sends the payload.
local function emit(base, etype, id, url)
  redis.call('XADD', events_key(base), '*', 'type', etype, 'id', id, 'url', url)
end

-- A request of a batch ended: count it, keep its result line, and end the batch if it
-- was the last one (one atomic transition, so one batch.* event).
local function batch_request_ended(base, batch_id, status, id, custom_id, output, err, now,
                                   ttl)
  local batch = batch_key(base, batch_id)
  if redis.call('EXISTS', batch) == 0 then return end  -- expired long ago
  local results = batch_results_key(base, batch_id)
  redis.call('HINCRBY', batch, BATCH_COUNTER[status], 1)
  redis.call('RPUSH', results, '{"custom_id":' .. cjson.encode(custom_id) .. ',"job_id":"'
    .. id .. '","status":"' .. status .. '","output":' .. (output or 'null')
    .. ',"error":' .. (err or 'null') .. '}')
  local b = redis.call('HMGET', batch, 'total', 'completed', 'failed', 'cancelled', 'status',
                       'webhook', 'webhook_events')
  local done = tonumber(b[2]) + tonumber(b[3]) + tonumber(b[4])
  if done < tonumber(b[1]) or b[5] == BATCH.COMPLETED or b[5] == BATCH.CANCELLED then return end
  local final = BATCH.COMPLETED
  if b[5] == BATCH.CANCELLING then final = BATCH.CANCELLED end
  redis.call('HSET', batch, 'status', final, final .. '_at', now)
  redis.call('EXPIRE', batch, ttl)
  redis.call('EXPIRE', results, ttl)
  redis.call('EXPIRE', batch_jobs_key(base, batch_id), ttl)
  local event = EVENT_OF_BATCH_END[final]
  if b[6] and wants(b[7], event) then emit(base, event, batch_id, b[6]) end
end

-- After a job's terminal fields are written: TTL, stats (interactive jobs) or batch
-- counts (batch requests), the recent list, the end of a streaming job's token stream,
-- the job-finished message, the webhook event.
local function ended(job, base, stats, recent, ttl, channel, id)
  redis.call('EXPIRE', job, ttl)
  local r = redis.call('HMGET', job, 'status', 'created_at', 'completed_at', 'batch',
                       'custom_id', 'output', 'error', 'webhook', 'webhook_events', 'stream')
  if r[10] == '1' then
    local tokens = tokens_key(base, id)
    redis.call('XADD', tokens, '*', 'type', 'end', 'status', r[1])
    redis.call('EXPIRE', tokens, ttl)
  end
  local status = r[1]
  if r[4] then
    redis.call('HINCRBY', stats, 'batch:finished:' .. status, 1)
    batch_request_ended(base, r[4], status, id, r[5], r[6], r[7], r[3], ttl)
  else
    redis.call('HINCRBY', stats, 'finished:' .. status, 1)
    local latency = tonumber(r[3]) - tonumber(r[2])
    observe(stats, 'latency', latency)
    redis.call('LPUSH', recent, r[3] .. ' ' .. latency .. ' ' .. status)
    redis.call('LTRIM', recent, 0, 999)
  end
  local event = EVENT_OF_END[status]
  if r[8] and wants(r[9], event) then emit(base, event, id, r[8]) end
  redis.call('PUBLISH', channel, id)
end
