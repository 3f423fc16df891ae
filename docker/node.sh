#!/bin/sh
# The compose `node` service: claim one shard directory and serve only that one.
#
# Replicas of one compose service cannot be given different volumes, so every replica sees the
# shard set read-only and claims one directory atomically (mkdir in the small `claims` volume):
# the first unclaimed one, or after a restart the one it held before (claims are keyed by the
# container's hostname). It serves and advertises only the records of that directory.
set -eu
SHARDS=${SHARDS:-/shards} CLAIMS=${CLAIMS:-/claims}
me=${NODE_NAME:-$(hostname)}
dir=""
for d in "$SHARDS"/current/node-*; do
    [ "$(cat "$CLAIMS/$(basename "$d")/owner" 2>/dev/null)" = "$me" ] && dir=$d && break
done
if [ -z "$dir" ]; then
    for d in "$SHARDS"/current/node-*; do
        if mkdir "$CLAIMS/$(basename "$d")" 2>/dev/null; then
            echo "$me" > "$CLAIMS/$(basename "$d")/owner"
            dir=$d
            break
        fi
    done
fi
if [ -z "$dir" ]; then
    echo "node: every shard directory in $SHARDS/current is claimed (raise NODES for prep)" >&2
    exit 1
fi
echo "node: container $me serves $dir"
# The shard set is read-only here: the node's key lives with its claim (kept across restarts),
# and so does its home (its ledger of signed receipts).
export MOESHARD_HOME="$CLAIMS/$(basename "$dir")"
# In the wide-area registry too when the bootstrap service has written its address.
boot=$(head -1 "${P2P:-/p2p}/bootstrap.addr" 2>/dev/null || true)
if [ -n "$boot" ]; then set -- "$@" --bootstrap "$boot"; fi
exec moeshard node "$dir" --host "${NODE_HOST:-0.0.0.0}" --port "${NODE_PORT:-50051}" \
    --name "$(basename "$dir")" --key "$CLAIMS/$(basename "$dir")/node-key.pem" \
    --allow "$SHARDS/client.id" --ram "${NODE_CACHE:-0}" "$@"
