#!/usr/bin/env bash
# `make demo`: the network mode on one machine. Splits MODEL's experts over three node daemons
# on loopback (every expert on two of them), lets the coordinator find them with zeroconf,
# generates through them, and stops them cleanly (SIGTERM: stop advertising, finish, exit 0).
# The coordinator runs on the directory `shard` writes for it (MODEL-shards/coordinator: the
# trunk, tokenizer and Merkle roots, no expert records), as it would on its own machine.
#
#   tools/demo_cluster.sh MODEL "PROMPT" [MAX_TOKENS]
set -euo pipefail
model=${1:?usage: tools/demo_cluster.sh MODEL PROMPT [MAX_TOKENS]}
prompt=${2:?usage: tools/demo_cluster.sh MODEL PROMPT [MAX_TOKENS]}
max_tokens=${3:-48}
py=${PY:-.venv/bin/python}
moeshard() { "$py" -m moeshard "$@"; }
shards="$model-shards"
base_port=${DEMO_PORT:-7171}
pids=()
# The coordinator's identity, found through MOESHARD_HOME by every moeshard command below;
# each node allows exactly this client (mutual TLS) and makes its own key in its shard directory.
export MOESHARD_HOME="$model-client"
mkdir -p "$MOESHARD_HOME"
[[ -f "$MOESHARD_HOME/key.pem" ]] || moeshard keygen "$MOESHARD_HOME/key.pem" >/dev/null
client=$(moeshard id "$MOESHARD_HOME/key.pem")

stop_nodes() {
    local code=$?
    if ((${#pids[@]})); then
        kill -TERM "${pids[@]}" 2>/dev/null || true
        for pid in "${pids[@]}"; do
            wait "$pid" 2>/dev/null || code=$((code ? code : 1))
        done
        echo "demo: stopped ${#pids[@]} nodes" >&2
    fi
    exit "$code"
}
trap stop_nodes EXIT
trap 'exit 130' INT TERM

for i in 0 1 2; do  # a node left over from an earlier run would answer in our place
    if moeshard health "127.0.0.1:$((base_port + i))" --timeout 1 >/dev/null 2>&1; then
        echo "demo: port $((base_port + i)) already serves a node; stop it or set DEMO_PORT" >&2
        exit 1
    fi
done
moeshard shard "$model" --nodes 3 --replicas 2 --out "$shards" --force >/dev/null
# Compile the kernels once (numba keeps them in its disk cache) before four processes would
# each compile them at the same time: on a fresh clone that is 1-2 minutes of one process
# instead of several minutes of four, and the nodes then start serving in about a second.
echo "demo: compiling the kernels (first run only: numba keeps them in its disk cache)..." >&2
started=$SECONDS
"$py" -c "from moeshard.moe.kernels import quant; from moeshard.moe.model import fused; quant.warmup(); fused.warmup()"
echo "demo: kernels ready in $((SECONDS - started)) s; starting 3 nodes" >&2
for i in 0 1 2; do
    port=$((base_port + i))
    # the python process itself in the background (not a function's subshell), so that
    # SIGTERM reaches the node daemon and `wait` gets its own exit code
    "$py" -m moeshard node "$shards/node-0$i" --host 127.0.0.1 --port "$port" \
        --name "demo-$i" --allow "$client" >"$shards/node-0$i.log" 2>&1 &
    pids+=($!)
done
for i in 0 1 2; do
    port=$((base_port + i))
    serving=0
    for _ in $(seq 300); do
        moeshard health "127.0.0.1:$port" --timeout 1 >/dev/null 2>&1 && { serving=1; break; }
        kill -0 "${pids[$i]}" 2>/dev/null || { cat "$shards/node-0$i.log" >&2; exit 1; }
        sleep 0.2
    done
    if ((!serving)); then
        echo "demo: node demo-$i is not serving on 127.0.0.1:$port; its log:" >&2
        cat "$shards/node-0$i.log" >&2
        exit 1
    fi
done
echo "demo: 3 nodes serving on 127.0.0.1:$base_port-$((base_port + 2)); discovering them with zeroconf" >&2
moeshard generate "$shards/coordinator" --discover --prompt "$prompt" --max-tokens "$max_tokens"
