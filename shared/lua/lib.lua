-- lib.lua: what every script shares. shared/scripts.py loads each script as
--   #!lua (no flags: in a Redis Cluster every key must hash to the slot of its KEYS)
--   the constants of shared/states.py and shared/stats.py (JOB, TERMINAL, BATCH, EVENT,
--     EVENT_OF_END, BATCH_COUNTER, EVENT_OF_BATCH_END, BUCKETS, INFLIGHT_TTL_S,
--     CACHE_ENTRY_OVERHEAD), generated from the enums and shared.cache
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
local function stats_key(base) return base .. 'stats' end
local function recent_key(base) return base .. 'recent' end
local function cache_key(base, digest) return base .. 'cache:' .. digest end
local function cache_index_key(base) return base .. 'cache-index' end
local function inflight_key(base, fp) return base .. 'inflight:' .. fp end
local function followers_key(base, id) return base .. 'followers:' .. id end
local function version_key(base) return base .. 'model-version' end
local function active_key(base, owner) return base .. 'active:' .. owner end
local function refunds_key(base) return base .. 'token-refunds' end
local function jobs_of_key(base, owner) return base .. 'jobs-of:' .. owner end

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
  if status == JOB.EXPIRED then redis.call('HINCRBY', batch, 'expired', 1) end  -- of failed
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

-- After a job's terminal fields are written: TTL, its API key's unfinished jobs and unused
-- tokens, stats (interactive jobs) or batch counts (batch requests), the recent list, the end of a streaming job's token stream,
-- the job-finished message, the webhook event.
local function ended(job, base, stats, recent, ttl, channel, id)
  redis.call('EXPIRE', job, ttl)
  local r = redis.call('HMGET', job, 'status', 'created_at', 'completed_at', 'batch',
                       'custom_id', 'output', 'error', 'webhook', 'webhook_events', 'stream',
                       'owner', 'charged')
  if r[11] then
    redis.call('SREM', active_key(base, r[11]), id)
    if r[12] then  -- give back the tokens per minute it was charged and did not generate
      local used = 0
      if r[6] then used = cjson.decode(r[6])['usage']['completion_tokens'] end
      local unused = tonumber(r[12]) - used
      if unused > 0 then redis.call('RPUSH', refunds_key(base), r[11] .. ' ' .. unused) end
      redis.call('HDEL', job, 'charged')  -- once: a dead letter queued again ends again
    end
  end
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

-- A job's text written to its token stream in one piece, if it streams (a cached result, or
-- the result of the job it followed).
local function whole_text(base, job, id, output)
  if redis.call('HGET', job, 'stream') ~= '1' then return end
  local text = cjson.decode(output).text
  if text ~= '' then
    redis.call('XADD', tokens_key(base, id), '*', 'type', 'token', 'delta', text, 'index', 0)
  end
end

-- A job now running: its status, start time and worker, and its job.started event.
local function mark_running(base, job, id, now, worker)
  redis.call('HSET', job, 'status', JOB.RUNNING, 'started_at', now, 'worker', worker)
  local r = redis.call('HMGET', job, 'webhook', 'webhook_events')
  if r[1] and wants(r[2], EVENT.JOB_STARTED) then emit(base, EVENT.JOB_STARTED, id, r[1]) end
end

-- --- the result cache and in-flight coalescing (shared.cache) ---------------------------
-- A cacheable job carries its request fingerprint (cache_fp) while it leads: inflight:{fp}
-- names it until its computation ends, and identical requests follow it (followers:{id};
-- a follower carries 'follows'). A leader whose own client leaves (cancel, deadline, its
-- batch cancelled) ends for that client alone while followers remain: its computation goes
-- on and ends them. When it ends, a success is cached under sha1(version fingerprint).

-- Whether an API key has fewer than ``cap`` unfinished interactive jobs. ended() removes
-- each job from the set; at the cap, members whose job is gone or ended anyway (a record
-- that expired) are dropped before counting again, so the set cannot leak its way full.
local function below_cap(base, owner, cap)
  local key = active_key(base, owner)
  if redis.call('SCARD', key) < cap then return true end
  for _, id in ipairs(redis.call('SMEMBERS', key)) do
    local status = redis.call('HGET', job_key(base, id), 'status')
    if status ~= 'queued' and status ~= 'running' then redis.call('SREM', key, id) end
  end
  return redis.call('SCARD', key) < cap
end

-- What a cacheable request with fingerprint fp becomes: 'hit', output | 'follow', leader
-- id | 'lead'.
local function lookup(base, fp)
  local version = redis.call('GET', version_key(base)) or ''
  local found = redis.call('MGET', cache_key(base, redis.sha1hex(version .. ' ' .. fp)),
                           inflight_key(base, fp))
  if found[1] then return 'hit', found[1] end
  local leader = found[2]
  if leader and redis.call('EXISTS', job_key(base, leader)) == 1 then return 'follow', leader end
  return 'lead', nil
end

-- Make a new job (its queued record written, with its cache_fp) what lookup() said.
-- Returns true when it leads, and so must be queued; a hit ends here, a follower waits
-- for its leader. Only a leader keeps cache_fp.
local function apply_lookup(base, job, id, fp, outcome, value, now, ttl, channel)
  local stats = stats_key(base)
  if outcome ~= 'lead' then redis.call('HDEL', job, 'cache_fp') end
  if outcome == 'hit' then
    redis.call('HINCRBY', stats, 'cache:hits', 1)
    redis.call('HSET', job, 'status', JOB.SUCCEEDED, 'output', value, 'started_at', now,
               'completed_at', now, 'inference_seconds', '0', 'cache_hit', '1')
    whole_text(base, job, id, value)
    ended(job, base, stats, recent_key(base), ttl, channel, id)
    return false
  end
  if outcome == 'follow' then
    redis.call('HINCRBY', stats, 'cache:coalesced', 1)
    redis.call('HSET', job, 'follows', value)
    redis.call('RPUSH', followers_key(base, value), id)
    local leader = redis.call('HMGET', job_key(base, value), 'started_at', 'worker')
    if leader[1] and leader[2] then mark_running(base, job, id, now, leader[2]) end
    return false
  end
  redis.call('HINCRBY', stats, 'cache:misses', 1)
  redis.call('SET', inflight_key(base, fp), id, 'EX', INFLIGHT_TTL_S)
  return true
end

-- Identical requests stop following job id's computation.
local function release(base, fp, id)
  local key = inflight_key(base, fp)
  if redis.call('GET', key) == id then redis.call('DEL', key) end
end

-- A job's record ended before its computation did. Returns true when followers still want
-- the computation (it goes on); else no later request may join it.
local function left(base, job, id)
  local fp = redis.call('HGET', job, 'cache_fp')
  if not fp then return false end
  if redis.call('LLEN', followers_key(base, id)) > 0 then return true end
  release(base, fp, id)
  return false
end

-- A follower ended on its own (canceled, expired): it leaves its leader's list; if its
-- leader's own client left too, nobody wants the work now, and its worker stops it.
local function unfollow(base, job, id)
  local leader_id = redis.call('HGET', job, 'follows')
  if not leader_id then return end
  local list = followers_key(base, leader_id)
  redis.call('LREM', list, 1, id)
  if redis.call('LLEN', list) > 0 then return end
  local leader = job_key(base, leader_id)
  local l = redis.call('HMGET', leader, 'status', 'cache_fp')
  if l[1] and TERMINAL[l[1]] and l[2] then
    redis.call('HSET', leader, 'cancel_requested', '1')
    release(base, l[2], leader_id)
  end
end

-- Store a result, keeping the model's cache under max_bytes: entries Redis expired are
-- forgotten first, then the soonest to expire are evicted.
local function cache_store(base, digest, output, cache_ttl, max_bytes, now)
  local key, index, stats = cache_key(base, digest), cache_index_key(base), stats_key(base)
  local size = #key + #output + CACHE_ENTRY_OVERHEAD
  if size > max_bytes or redis.call('EXISTS', key) == 1 then return end
  local freed, expired = 0, 0
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now, 'LIMIT', 0, 256)) do
    freed, expired = freed + tonumber(string.match(member, '%d+$')), expired + 1
    redis.call('ZREM', index, member)
  end
  if expired > 0 then redis.call('HINCRBY', stats, 'cache:expired', expired) end
  redis.call('SET', key, output, 'EX', cache_ttl)
  redis.call('ZADD', index, now + cache_ttl, digest .. ' ' .. size)
  local bytes = redis.call('HINCRBY', stats, 'cache:bytes', size - freed)
  while bytes > max_bytes do
    local oldest = redis.call('ZPOPMIN', index)
    if #oldest == 0 then break end
    local gone, gone_size = string.match(oldest[1], '^(%x+) (%d+)$')
    redis.call('DEL', cache_key(base, gone))
    bytes = redis.call('HINCRBY', stats, 'cache:bytes', -tonumber(gone_size))
    redis.call('HINCRBY', stats, 'cache:evictions', 1)
  end
end

-- The computation of job id ended with these terminal fields (field, value, ... from
-- index `from` of `fields`): a success is cached (when a version is given), its followers
-- end the same way, and the next identical request leads again.
local function settle(base, job, id, fields, from, version, cache_ttl, max_bytes, ttl, channel)
  local fp = redis.call('HGET', job, 'cache_fp')
  if not fp then return end
  release(base, fp, id)
  local result = {}
  for i = from, #fields, 2 do result[fields[i]] = fields[i + 1] end
  cache_ttl = tonumber(cache_ttl)
  if result.status == JOB.SUCCEEDED and version ~= '' and cache_ttl > 0 then
    cache_store(base, redis.sha1hex(version .. ' ' .. fp), result.output, cache_ttl,
                tonumber(max_bytes), tonumber(result.completed_at))
  end
  local list = followers_key(base, id)
  local followers = redis.call('LRANGE', list, 0, -1)
  redis.call('DEL', list)
  local stats, recent = stats_key(base), recent_key(base)
  for _, f in ipairs(followers) do
    local fjob = job_key(base, f)
    local status = redis.call('HGET', fjob, 'status')
    if status and not TERMINAL[status] then
      redis.call('HSET', fjob, unpack(fields, from))
      if result.output then whole_text(base, fjob, f, result.output) end
      ended(fjob, base, stats, recent, ttl, channel, f)
    end
  end
end
