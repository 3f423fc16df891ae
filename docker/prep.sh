#!/bin/sh
# The compose `prep` service (one-shot): model directory + one shard directory per node.
#
#   /checkpoints/$CHECKPOINT   a Hugging Face checkpoint (converted into /data/model) or an
#                              already converted moeshard model directory (used in place)
#   fallback                   the demo model baked into the image (models/demo-hf), else the
#                              tiny test fixture
#   /shards/current/node-NN    `moeshard shard --nodes $NODES --replicas $REPLICAS`
#
# Idempotent: a re-run with the same inputs changes nothing (running nodes keep their shards).
set -eu
DATA=${DATA:-/data} SHARDS=${SHARDS:-/shards} CLAIMS=${CLAIMS:-/claims} CLIENT=${CLIENT:-/client}
CHECKPOINTS=${CHECKPOINTS:-/checkpoints} APP=${APP:-/app}
NODES=${NODES:-3}
REPLICAS=${REPLICAS:-2}
EXPERTS=${EXPERTS:-q4_0}
CHECKPOINT=${CHECKPOINT:-demo-hf}
if [ "$REPLICAS" -gt "$NODES" ]; then REPLICAS=$NODES; fi

src=$CHECKPOINTS/$CHECKPOINT
if [ ! -f "$src/config.json" ]; then
    for src in "$APP/models/demo-hf" "$APP/fixtures/qwen3_moe"; do
        [ -f "$src/config.json" ] && break
    done
    echo "prep: $CHECKPOINTS/$CHECKPOINT has no config.json; using $src"
fi

if [ -f "$src/moeshard.json" ]; then  # already converted: use it where it is
    stamp="converted $src"
    if [ "$(cat "$DATA/model.stamp" 2>/dev/null)" != "$stamp" ]; then
        rm -rf "$DATA/model" && ln -s "$src" "$DATA/model"
        echo "$stamp" > "$DATA/model.stamp"
    fi
else
    stamp="convert $src experts=$EXPERTS $(ls -l --time-style=+%s "$src" | md5sum | cut -c1-12)"
    if [ "$(cat "$DATA/model.stamp" 2>/dev/null)" != "$stamp" ]; then
        rm -f "$DATA/model.stamp"
        moeshard convert "$src" "$DATA/model" --force --quiet --experts "$EXPERTS"
        echo "$stamp" > "$DATA/model.stamp"
    else
        echo "prep: $DATA/model is current ($src)"
    fi
fi

plan="$(cat "$DATA/model.stamp") nodes=$NODES replicas=$REPLICAS"
if [ "$(cat "$SHARDS/plan.stamp" 2>/dev/null)" != "$plan" ]; then
    rm -f "$SHARDS/plan.stamp"
    moeshard shard "$DATA/model" --nodes "$NODES" --replicas "$REPLICAS" --out "$SHARDS/current" --force
    rm -rf "$CLAIMS"/node-*  # new shards: every node claims afresh
    echo "$plan" > "$SHARDS/plan.stamp"
else
    echo "prep: $SHARDS/current is current ($NODES nodes, $REPLICAS replicas)"
fi
# The coordinator's identity (mutual TLS): its key stays in the client volume, which only prep
# and the coordinator mount (the coordinator keeps its ledger and the nodes' reputations there
# too); the nodes read just its id, the one client they allow.
[ -f "$CLIENT/key.pem" ] || moeshard keygen "$CLIENT/key.pem" >/dev/null
moeshard id "$CLIENT/key.pem" > "$SHARDS/client.id"
echo "prep: coordinator id $(cat "$SHARDS/client.id")"
moeshard inspect "$DATA/model" | head -4
