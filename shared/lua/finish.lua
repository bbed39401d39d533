-- finish: store a job's terminal fields and acknowledge its entry, in one step.
-- KEYS: [1] the job, [2] its lane's stream, [3] the model's stats, [4] its recent list
-- ARGV: [1] consumer group, [2] entry id, [3] result TTL s, [4] job-finished channel,
--       [5] job id, [6] the model's key base, [7] the last text delta of a streaming job
--       ('' if none), [8] its index, [9] the worker's model version ('' : cache nothing),
--       [10] cache TTL s, [11] cache max bytes, [12..] field, value, ... (none: just drop)
-- Reply: 'stored', or 'skipped' when the job was gone or already terminal (a terminal
--   job never changes again).
-- An entry is acked only here, with its job's end stored, and only acked entries are
-- deleted: nothing unread is ever trimmed, so the group's lag stays exact. A streaming
-- job's last delta and its end event are written in this same step (see ended()). The
-- jobs following this one end with it, and a success is cached (see settle()), also when
-- the job itself had ended for its own client.
local status = redis.call('HGET', KEYS[1], 'status')
local reply = 'skipped'
if status and #ARGV >= 12 then
  if not TERMINAL[status] then
    if ARGV[7] ~= '' then
      redis.call('XADD', tokens_key(ARGV[6], ARGV[5]), '*', 'type', 'token', 'delta', ARGV[7],
                 'index', ARGV[8])
    end
    redis.call('HSET', KEYS[1], unpack(ARGV, 12))
    ended(KEYS[1], ARGV[6], KEYS[3], KEYS[4], ARGV[3], ARGV[4], ARGV[5])
    reply = 'stored'
  end
  settle(ARGV[6], KEYS[1], ARGV[5], ARGV, 12, ARGV[9], ARGV[10], ARGV[11], ARGV[3], ARGV[4])
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
return reply
