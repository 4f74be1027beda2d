"""The registry's Redis scripts. Each mutation is one script, so it is atomic: no other client's command runs in
between, and a half-applied change is impossible. Scripts build key names from the prefix in ARGV[1] (the
registry runs on a single Redis/Valkey, not a cluster).

Keys (P = key prefix):
  P adapters                  ZSET  adapter names (score 0, so ZRANGEBYLEX pages through them in order)
  P a:<name>                  HASH  adapter fields + `latest`
  P a:<name>:seq              INCR  version counter
  P a:<name>:aliases          HASH  alias -> version
  P a:<name>:versions         ZSET  every version (score = version)
  P a:<name>:kind:<k>         ZSET  versions of one kind (1 = weights)
  P a:<name>:v:<n>            HASH  version fields
  P a:<name>:idem             HASH  idempotency key -> version
  P blobrefs                  HASH  sha256 -> number of versions referencing the blob
  P blobrefs:pending          HASH  sha256 -> how many of those are reserved, their bytes not stored yet (so
                                    blobrefs > blobrefs:pending means a stored version holds the blob: it is in S3)
  P blobs:pending:<sha>       HASH  upload token -> expiry (ms); an upload in progress protects its blob from GC
  P blobs:deleting:<sha>      STR   set while GC deletes that blob (with a TTL); uploads of it wait
  P commit:<token>            STR   version committed by one publish attempt (1 h), makes a retried commit safe
  P events                    STREAM
Event fields: t type, a adapter, v version, s sha256, al alias, k kind, ts time (ms).
"""

COMMON = r"""
local P = ARGV[1]
local MAXLEN = ARGV[2]
local function akey(name, suffix) return P .. 'a:' .. name .. (suffix or '') end

local function emit(etype, name, version, sha, alias, kind, now)
  return redis.call('XADD', P .. 'events', 'MAXLEN', '~', MAXLEN, '*',
    't', etype, 'a', name, 'v', version, 's', sha, 'al', alias, 'k', kind, 'ts', now)
end

local function unref(sha, freed)
  local left = redis.call('HINCRBY', P .. 'blobrefs', sha, -1)
  if left <= 0 then
    redis.call('HDEL', P .. 'blobrefs', sha)
    table.insert(freed, sha)
  end
end

-- A reserved version whose bytes are not stored stops counting as pending (stored, or about to be deleted).
local function unpend(vkey, sha)
  if redis.call('HGET', vkey, 'pending') ~= '1' then return end
  redis.call('HDEL', vkey, 'pending')
  if redis.call('HINCRBY', P .. 'blobrefs:pending', sha, -1) <= 0 then
    redis.call('HDEL', P .. 'blobrefs:pending', sha)
  end
end

local function drop_version(name, v, freed, now)
  local vkey = akey(name, ':v:' .. v)
  local fields = redis.call('HMGET', vkey, 'kind', 'sha256', 'idem')
  if not fields[2] then return end
  unpend(vkey, fields[2])
  redis.call('DEL', vkey)
  redis.call('ZREM', akey(name, ':versions'), v)
  redis.call('ZREM', akey(name, ':kind:' .. fields[1]), v)
  if fields[3] and fields[3] ~= '' then redis.call('HDEL', akey(name, ':idem'), fields[3]) end
  unref(fields[2], freed)
  emit(4, name, v, fields[2], '', fields[1], now)
end

local function refresh_latest(name)
  local top = redis.call('ZREVRANGE', akey(name, ':kind:1'), 0, 0)
  redis.call('HSET', akey(name), 'latest', top[1] or 0)
end

local function enforce_retention(name, freed, now)
  local keep = tonumber(redis.call('HGET', akey(name), 'keep_last') or '0')
  if keep <= 0 then return end
  local wkey = akey(name, ':kind:1')
  local count = redis.call('ZCARD', wkey)
  if count <= keep then return end
  -- The newest `keep` weights versions stay; older ones go unless an alias pins them.
  local pinned = {}
  for _, v in ipairs(redis.call('HVALS', akey(name, ':aliases'))) do pinned[v] = true end
  for _, v in ipairs(redis.call('ZRANGE', wkey, 0, count - keep - 1)) do
    if not pinned[v] then drop_version(name, v, freed, now) end
  end
end
"""

# ARGV: P, maxlen, name, now, lora_json, base_model, keep_last, metadata_json -> 1 created, 0 exists
CREATE_ADAPTER = COMMON + r"""
local name, now = ARGV[3], ARGV[4]
if redis.call('EXISTS', akey(name)) == 1 then return 0 end
redis.call('HSET', akey(name), 'name', name, 'lora', ARGV[5], 'base_model', ARGV[6], 'keep_last', ARGV[7],
  'metadata', ARGV[8], 'create_time', now, 'latest', 0)
redis.call('ZADD', P .. 'adapters', 0, name)
emit(1, name, 0, '', '', 0, now)
return 1
"""

# ARGV: P, maxlen, name, now, idem, kind, sha, size, step, metadata_json, upload_token, pending ('1' = reserved,
# its bytes still to come, unless a stored version already holds that blob: then it is committed stored), aliases...
# -> {-1} no adapter | {version, deduplicated, freed_sha...}
PUBLISH = COMMON + r"""
local name, now, idem, kind, sha = ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
redis.call('HDEL', P .. 'blobs:pending:' .. sha, ARGV[11])
-- A retry of this very commit (its reply was lost to a dropped connection) returns what the first run did.
local done = redis.call('GET', P .. 'commit:' .. ARGV[11])
if done then return {tonumber(done), 0} end
if redis.call('EXISTS', akey(name)) == 0 then return {-1} end
if idem ~= '' then
  local prior = redis.call('HGET', akey(name, ':idem'), idem)
  if prior then return {tonumber(prior), 1} end
end
local v = redis.call('INCR', akey(name, ':seq'))
redis.call('SET', P .. 'commit:' .. ARGV[11], v, 'EX', 3600)
redis.call('HSET', akey(name, ':v:' .. v), 'kind', kind, 'sha256', sha, 'size', ARGV[8], 'step', ARGV[9],
  'metadata', ARGV[10], 'create_time', now, 'idem', idem)
if ARGV[12] == '1' then
  local refs = tonumber(redis.call('HGET', P .. 'blobrefs', sha) or '0')
  local reserved = tonumber(redis.call('HGET', P .. 'blobrefs:pending', sha) or '0')
  -- Only a version whose bytes were stored (or a reservation) references a blob, and GC keeps referenced blobs.
  if refs <= reserved then
    redis.call('HSET', akey(name, ':v:' .. v), 'pending', '1')
    redis.call('HINCRBY', P .. 'blobrefs:pending', sha, 1)
  end
end
redis.call('ZADD', akey(name, ':versions'), v, v)
redis.call('ZADD', akey(name, ':kind:' .. kind), v, v)
if idem ~= '' then redis.call('HSET', akey(name, ':idem'), idem, v) end
redis.call('HINCRBY', P .. 'blobrefs', sha, 1)
if kind == '1' then redis.call('HSET', akey(name), 'latest', v) end
emit(2, name, v, sha, '', kind, now)
for i = 13, #ARGV do
  redis.call('HSET', akey(name, ':aliases'), ARGV[i], v)
  emit(3, name, v, sha, ARGV[i], kind, now)
end
local freed = {}
if kind == '1' then enforce_retention(name, freed, now) end
return {v, 0, unpack(freed)}
"""

# ARGV: P, maxlen, name, version, sha -> 1 the reserved version is now stored | 0 no such version (deleted) with that
# sha256. Its blob is in storage when this runs, so downloads of it may start.
STORED = COMMON + r"""
local vkey = akey(ARGV[3], ':v:' .. ARGV[4])
if redis.call('HGET', vkey, 'sha256') ~= ARGV[5] then return 0 end
unpend(vkey, ARGV[5])
return 1
"""

# ARGV: P, maxlen, name, now, alias, version
# -> {-1} no adapter | {-2} no version | {-3} not weights | {0} unchanged | {1, freed_sha...}
SET_ALIAS = COMMON + r"""
local name, now, alias, version = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
if redis.call('EXISTS', akey(name)) == 0 then return {-1} end
local current = redis.call('HGET', akey(name, ':aliases'), alias)
local freed = {}
if version == '0' then
  if not current then return {0} end
  redis.call('HDEL', akey(name, ':aliases'), alias)
  emit(3, name, 0, '', alias, 0, now)
  -- The version it pinned may now fall outside keep_last.
  enforce_retention(name, freed, now)
  return {1, unpack(freed)}
end
local fields = redis.call('HMGET', akey(name, ':v:' .. version), 'kind', 'sha256')
if not fields[2] then return {-2} end
if fields[1] ~= '1' then return {-3} end
if current == version then return {0} end
redis.call('HSET', akey(name, ':aliases'), alias, version)
emit(3, name, version, fields[2], alias, fields[1], now)
enforce_retention(name, freed, now)
return {1, unpack(freed)}
"""

# ARGV: P, maxlen, name, now, version -> {-1} no adapter | {-2} no version | {-3, alias} pinned | {1, freed...}
DELETE_VERSION = COMMON + r"""
local name, now, version = ARGV[3], ARGV[4], ARGV[5]
if redis.call('EXISTS', akey(name)) == 0 then return {-1} end
if redis.call('EXISTS', akey(name, ':v:' .. version)) == 0 then return {-2} end
local aliases = redis.call('HGETALL', akey(name, ':aliases'))
for i = 1, #aliases, 2 do
  if aliases[i + 1] == version then return {-3, aliases[i]} end
end
local freed = {}
drop_version(name, version, freed, now)
refresh_latest(name)
return {1, unpack(freed)}
"""

# ARGV: P, maxlen, name, now -> {-1} no adapter | {1, freed...}
DELETE_ADAPTER = COMMON + r"""
local name, now = ARGV[3], ARGV[4]
if redis.call('EXISTS', akey(name)) == 0 then return {-1} end
local freed = {}
for _, v in ipairs(redis.call('ZRANGE', akey(name, ':versions'), 0, -1)) do
  local sha = redis.call('HGET', akey(name, ':v:' .. v), 'sha256')
  if sha then unpend(akey(name, ':v:' .. v), sha) end
  redis.call('DEL', akey(name, ':v:' .. v))
  if sha then unref(sha, freed) end
end
redis.call('DEL', akey(name), akey(name, ':seq'), akey(name, ':aliases'), akey(name, ':versions'),
  akey(name, ':kind:1'), akey(name, ':kind:2'), akey(name, ':idem'))
redis.call('ZREM', P .. 'adapters', name)
emit(5, name, 0, '', '', 0, now)
return {1, unpack(freed)}
"""

# ARGV: P, maxlen, sha, token, expiry_ms -> 1 registered | 0 the blob is being deleted right now (retry)
REGISTER_UPLOAD = COMMON + r"""
if redis.call('EXISTS', P .. 'blobs:deleting:' .. ARGV[3]) == 1 then return 0 end
redis.call('HSET', P .. 'blobs:pending:' .. ARGV[3], ARGV[4], ARGV[5])
return 1
"""

# ARGV: P, maxlen, sha, token
FORGET_UPLOAD = COMMON + r"""
redis.call('HDEL', P .. 'blobs:pending:' .. ARGV[3], ARGV[4])
return 1
"""

# ARGV: P, maxlen, sha, now_ms, ttl_ms, dry_run -> 1 claimed (unreferenced, no live upload) | 0 keep it
CLAIM_GARBAGE = COMMON + r"""
local sha, now = ARGV[3], tonumber(ARGV[4])
if tonumber(redis.call('HGET', P .. 'blobrefs', sha) or '0') > 0 then return 0 end
local pkey = P .. 'blobs:pending:' .. sha
local pending = redis.call('HGETALL', pkey)
local live = false
for i = 1, #pending, 2 do
  if tonumber(pending[i + 1]) > now then live = true else redis.call('HDEL', pkey, pending[i]) end
end
if live then return 0 end
if ARGV[6] ~= '1' then redis.call('SET', P .. 'blobs:deleting:' .. sha, '1', 'PX', ARGV[5]) end
return 1
"""

# ARGV: P, maxlen, sha
RELEASE_GARBAGE = COMMON + r"""
redis.call('DEL', P .. 'blobs:deleting:' .. ARGV[3])
return 1
"""
