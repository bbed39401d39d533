-- dead_letter: move a poison entry to the dead-letter stream and fail its job (and the
-- jobs following it: settle()).
-- KEYS: [1] the job, [2] its lane's stream, [3] the model's dead letters, [4] stats,
--       [5] recent list
-- ARGV: [1] consumer group, [2] entry id, [3] job id, [4] times delivered, [5] now,
--       [6] result TTL s, [7] job-finished channel, [8] lane, [9] the model's key base,
--       [10..] field, value, ... (the job's terminal fields)
-- Reply: 'dead'.
redis.call('XADD', KEYS[3], '*', 'job', ARGV[3], 'entry', ARGV[2], 'deliveries', ARGV[4],
           'at', ARGV[5], 'lane', ARGV[8])
local status = redis.call('HGET', KEYS[1], 'status')
if status and not TERMINAL[status] then
  redis.call('HSET', KEYS[1], unpack(ARGV, 10))
  ended(KEYS[1], ARGV[9], KEYS[4], KEYS[5], ARGV[6], ARGV[7], ARGV[3])
end
if status then settle(ARGV[9], KEYS[1], ARGV[3], ARGV, 10, '', 0, 0, ARGV[6], ARGV[7]) end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
return 'dead'
