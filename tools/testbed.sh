#!/usr/bin/env bash
# Multi-node testbed in Linux network namespaces: the compose topology (a coordinator + 3 nodes)
# on a real L2 segment, no Docker engine needed. Needs root (CAP_NET_ADMIN), iproute2 and,
# for the latency rows, `tc netem` or else nftables (see tools/testbed.py).
#
#   mstb-sw      a "switch" namespace holding the bridge mstb-br and the bridge ends of the veths
#   mstb-coord   10.199.0.1    coordinator   (veth eth0 <-> mstb-sw:coord)
#   mstb-n1..n3  10.199.0.11-13 node daemons (veth eth0 <-> mstb-sw:n1..n3)
#   mstb-x       10.199.0.21   a node serving ANOTHER model (must be ignored)
#
# 10.199.0.0/24 exists only on this bridge: no default route, no NAT, nothing in the root
# namespace (the bridge itself lives in mstb-sw). Each namespace routes 224.0.0.0/4 on its veth
# so zeroconf (mDNS) multicast crosses the bridge. Everything is torn down on exit, on failure and
# on Ctrl-C; a re-run first removes leftovers of a crashed run by the "mstb-" name prefix.
#
#   tools/testbed.sh [testbed.py options]      e.g.  tools/testbed.sh --model models/demo-hf
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=mstb
SUBNET=10.199.0
PY=${PY:-.venv/bin/python}
HOSTS=(coord:1 n1:11 n2:12 n3:13 x:21)

if [[ $(id -u) -ne 0 ]]; then
    echo "testbed: needs root (network namespaces); try: sudo $0" >&2
    exit 2
fi
command -v ip >/dev/null || { echo "testbed: needs iproute2 (ip)" >&2; exit 2; }

cleanup() {
    local ns pids
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${PREFIX}-" || true); do
        # Only processes inside our own namespaces: the daemons this testbed started.
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            kill -TERM $pids 2>/dev/null || true
            sleep 0.5
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [[ -n $pids ]] && kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$ns" 2>/dev/null || true
    done
    # Veths/bridges die with their namespace; also catch any that leaked into the root one.
    for dev in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 \
                 | grep "^${PREFIX}-" || true); do
        ip link del "$dev" 2>/dev/null || true
    done
}

teardown() {
    local rc=$?
    trap - EXIT INT TERM
    cleanup
    if [[ -n $(ip netns list | grep "^${PREFIX}-" || true) ]]; then
        echo "testbed: WARNING: namespaces left behind" >&2
    else
        echo "testbed: torn down (namespaces ${PREFIX}-*, bridge ${PREFIX}-br)" >&2
    fi
    exit "$rc"
}

cleanup  # leftovers of a crashed run
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add "${PREFIX}-sw"
ip -n "${PREFIX}-sw" link set lo up
ip -n "${PREFIX}-sw" link add "${PREFIX}-br" type bridge mcast_snooping 0 stp_state 0
ip -n "${PREFIX}-sw" link set "${PREFIX}-br" up

for entry in "${HOSTS[@]}"; do
    name=${entry%%:*}
    octet=${entry##*:}
    ns="${PREFIX}-${name}"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # Create the pair inside the host namespace, then move the switch end into mstb-sw.
    ip -n "$ns" link add eth0 type veth peer name "$name"
    ip -n "$ns" link set "$name" netns "${PREFIX}-sw"
    ip -n "${PREFIX}-sw" link set "$name" master "${PREFIX}-br" up
    ip -n "$ns" addr add "${SUBNET}.${octet}/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" route add 224.0.0.0/4 dev eth0  # mDNS (224.0.0.251) out of this veth
    ip netns exec "$ns" sysctl -q -w net.ipv6.conf.all.disable_ipv6=1
done

echo "testbed: namespaces up: $(ip netns list | awk '{print $1}' | grep "^${PREFIX}-" | sort | tr '\n' ' ')" >&2
"$PY" tools/testbed.py --prefix "$PREFIX" --subnet "$SUBNET" "$@"
