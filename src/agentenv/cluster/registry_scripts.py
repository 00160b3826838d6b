"""The Lua scripts of the cluster registry (``node_registry.py``): each reads and
changes a few of its keys atomically, in one round trip."""

# sbx:<id> and, with the node it names, node:<n>, alive:<n>, reserved:<n>, and the room
# freed since its heartbeat (released:<n> + freed-n:<n>). The node keys are derived
# inside the script: fine on one Redis (not for Redis Cluster).
ROUTE = """
local entry = redis.call('HGETALL', KEYS[1])
if #entry == 0 then return false end
local node = ''
for i = 1, #entry, 2 do if entry[i] == 'node' then node = entry[i + 1] end end
local p = ARGV[1]
local freed = tonumber(redis.call('GET', p .. 'released:' .. node) or '0')
              + tonumber(redis.call('GET', p .. 'freed-n:' .. node) or '0')
return {entry, redis.call('GET', p .. 'node:' .. node),
        redis.call('EXISTS', p .. 'alive:' .. node), redis.call('GET', p .. 'reserved:' .. node),
        freed}
"""

# released:<n> += 1 if beat:<n> is still ARGV[1] (no heartbeat since the caller read it).
RELEASE = """
if (redis.call('GET', KEYS[1]) or '0') ~= ARGV[1] then return 0 end
redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""


# A sandbox ended or paused through the gateway (ARGV[1]) is room on its node (freed:<n>,
# its count freed-n:<n>) until a heartbeat no longer counts it; both kept ARGV[2] ms.
FREE = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then redis.call('INCR', KEYS[2]) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
"""

# A paused sandbox resumed takes a slot again: back out of freed:<n> if it is there
# (no heartbeat has seen its pause yet), else reserved:<n> += 1 until a heartbeat.
TAKE = """
if redis.call('SREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('DECR', KEYS[2])
  return 0
end
redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return 1
"""

# A heartbeat that no longer counts these freed sandboxes (ARGV) as running: its load
# shows their room, so freed:<n> stops counting it.
SETTLE = """
for _, sid in ipairs(ARGV) do
  if redis.call('SREM', KEYS[1], sid) == 1 then redis.call('DECR', KEYS[2]) end
end
"""

# reserved:<n> += 1 if room:<n> (room at the last heartbeat) is more than reserved:<n>
# less released:<n> and freed-n:<n>; the heartbeat's number, or false when the node
# is full.
RESERVE_ROOM = """
local room = redis.call('GET', KEYS[1])
if room then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
               - tonumber(redis.call('GET', KEYS[3]) or '0')
               - tonumber(redis.call('GET', KEYS[5]) or '0')
  if used >= tonumber(room) then return false end
end
redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return redis.call('GET', KEYS[4]) or '0'
"""
