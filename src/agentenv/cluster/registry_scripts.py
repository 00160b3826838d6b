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

# A heartbeat claims its node (KEYS[1] hb:<n>: the node process's session, the number of
# the beat last applied, the diffs since the last full beat, and the claim's token):
# a diff (ARGV[3] its base, '' for a full beat) only on top of the beat it is against,
# of the same session, while the node is up; a full beat only if it is not older than
# the one applied (an earlier session, or an earlier beat of this one). Refused: {-1},
# nothing changed (the node is asked for a full beat). Claimed: the node's liveness and
# room recorded as one (KEYS[2..9]: node, alive, room, reserved, released, beat, down,
# nodes); {was alive, the beat's number, diffs since the last full beat}. A beat with no
# session (an older node's: full) always applies. ARGV: session, seq, base, token, body,
# ttl_ms, room, node ID.
CLAIM = """
local session, seq, base = ARGV[1], ARGV[2], ARGV[3]
local cur = redis.call('HMGET', KEYS[1], 'session', 'seq', 'diffs')
local alive = redis.call('EXISTS', KEYS[3])
local diffs = 0
if base ~= '' then
  if alive == 0 or cur[1] ~= session or cur[2] ~= base then return {-1} end
  diffs = tonumber(cur[3] or '0') + 1
elseif session ~= '' and cur[1] and cur[1] ~= '' then
  if session < cur[1] then return {-1} end
  if session == cur[1] and tonumber(seq) <= tonumber(cur[2] or '0') then return {-1} end
end
redis.call('HSET', KEYS[1], 'session', session, 'seq', seq, 'diffs', diffs, 'token', ARGV[4])
redis.call('SET', KEYS[2], ARGV[5])
redis.call('SET', KEYS[3], '1', 'PX', ARGV[6])
redis.call('SET', KEYS[4], ARGV[7])
redis.call('DEL', KEYS[5], KEYS[6])
local beat = redis.call('INCR', KEYS[7])
redis.call('SREM', KEYS[8], ARGV[8])
redis.call('SADD', KEYS[9], ARGV[8])
return {alive, beat, diffs}
"""

# The sandboxes of a heartbeat (ARGV[3..]: ID, fingerprint, ...) whose record differs
# from it (another node's or none, or written by another heartbeat or by the gateway),
# and that the gateway did not kill since (forgotten:<id>): {ID, node, key, ix, state}
# each ('' for none). One command for a node's hundreds, not one per sandbox; the keys
# are derived from the prefix (ARGV[1]) and node (ARGV[2]) as ROUTE's are.
DIFFERING = """
local p, nid, out = ARGV[1], ARGV[2], {}
for i = 3, #ARGV, 2 do
  local sid = ARGV[i]
  local r = redis.call('HMGET', p .. 'sbx:' .. sid, 'node', 'key', 'ix', 'fp', 'state')
  if (r[1] ~= nid or r[4] ~= ARGV[i + 1])
      and redis.call('EXISTS', p .. 'forgotten:' .. sid) == 0 then
    out[#out + 1] = {sid, r[1] or '', r[2] or '', r[3] or '', r[5] or ''}
  end
end
return out
"""

# Runs a list of commands (decoded JSON), as a pipeline would, with two of its own:
# - SETTLE <freed> <freed-n> IDs: these out of freed:<n>, its count less those that
#   were in it;
# - GUARD <key> <n> <field> <value> ...: the next n commands run only if the hash <key>
#   still holds these values ('' for none), as read when they were made; a record
#   written meanwhile (by the gateway, between a heartbeat's read and its writes) is
#   left as it is. Returns how many guards failed.
_RUN = """
local function run(commands)
  local skip, failed = 0, 0
  for _, c in ipairs(commands) do
    if skip > 0 then
      skip = skip - 1
    elseif c[1] == 'GUARD' then
      for i = 4, #c, 2 do
        if (redis.call('HGET', c[2], c[i]) or '') ~= c[i + 1] then
          skip, failed = tonumber(c[3]), failed + 1
          break
        end
      end
    elseif c[1] == 'SETTLE' then
      for i = 4, #c do
        if redis.call('SREM', c[2], c[i]) == 1 then redis.call('DECR', c[3]) end
      end
    else
      redis.call(unpack(c))
    end
  end
  return failed
end
"""

# A heartbeat's writes (ARGV[2]: JSON, commands as _RUN takes them) if the claim of the
# node (KEYS[1] hb:<n>) is still its own (token ARGV[1]): {1, guards failed}; else
# nothing written, {0, 0} (a later beat of the node claimed it). Atomic, as MULTI would
# be, and one round trip where WATCH, the check and MULTI took three.
APPLY = _RUN + """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return {0, 0} end
return {1, run(cjson.decode(ARGV[2]))}
"""

# Commands (ARGV[1], JSON, as _RUN takes them; the first a GUARD) run as one: the
# gateway's change of a sandbox's record, made from what it read, only if the record
# is still as read. Returns how many guards failed (0: written).
GUARDED = _RUN + """
return run(cjson.decode(ARGV[1]))
"""
