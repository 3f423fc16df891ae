#!/usr/bin/env bash
# Validate compose.yaml with a real Compose implementation's `config` command (no Docker engine
# needed): Docker Compose v2 (`docker compose`) when the docker CLI has the plugin, and/or
# docker-compose 1.29 from Debian (installed here with apt when missing, without the engine).
# Then check the swarm's shape on the resolved config: NODES scales the node service, health
# checks use `moeshard health`, nodes wait for prep and the bootstrap peer, the coordinator for
# healthy nodes.
# Usage: tools/check_compose.sh [FILE]   (default compose.yaml)
# Skips (exit 0, with the reason) only when no implementation can be installed at all.
set -euo pipefail
cd "$(dirname "$0")/.."
file=${1:-compose.yaml}

validators=()
if docker compose version >/dev/null 2>&1; then
    validators+=("docker compose")
fi
if ! command -v docker-compose >/dev/null 2>&1 && [[ $(id -u) -eq 0 ]] \
    && command -v apt-get >/dev/null 2>&1; then
    echo "check_compose: installing docker-compose (Debian) for its config validator" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends docker-compose >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 \
             && apt-get install -y -q --no-install-recommends docker-compose >/dev/null 2>&1; } \
        || true
fi
if command -v docker-compose >/dev/null 2>&1; then
    validators+=("docker-compose")
fi
if [[ ${#validators[@]} -eq 0 ]]; then
    echo "check_compose: SKIP: no Compose implementation (docker compose v2 or docker-compose)" \
         "could be installed here; compose.yaml not validated" >&2
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for v in "${validators[@]}"; do
    echo "check_compose: $($v version 2>/dev/null | head -1)" >&2
    $v -f "$file" config -q
    NODES=5 REPLICAS=3 NODE_MEMORY=2g $v -f "$file" config > "$tmp/config.yaml"
    python3 - "$tmp/config.yaml" <<'PY'
import sys

import yaml

cfg = yaml.safe_load(open(sys.argv[1]))
s = cfg["services"]
problems = []
if set(s) != {"prep", "bootstrap", "node", "coordinator"}:
    problems.append(f"services are {sorted(s)}, want prep, bootstrap, node, coordinator")
node = s.get("node", {})
if node.get("deploy", {}).get("replicas") != 5:
    problems.append("NODES=5 does not scale the node service to 5 replicas")
if node.get("deploy", {}).get("resources", {}).get("limits", {}).get("memory") in (None, ""):
    problems.append("node has no RAM limit")
for name in ("node",):
    test = " ".join(s.get(name, {}).get("healthcheck", {}).get("test", []))
    if "moeshard health" not in test:
        problems.append(f"{name} health check does not use `moeshard health`: {test!r}")
if s.get("prep", {}).get("environment", {}).get("NODES") not in ("5", 5):
    problems.append("prep does not shard for NODES")
dep = node.get("depends_on", {}).get("prep", {}).get("condition")
if dep != "service_completed_successfully":
    problems.append(f"node does not wait for prep to complete ({dep})")
dep = node.get("depends_on", {}).get("bootstrap", {}).get("condition")
if dep != "service_healthy":
    problems.append(f"node does not wait for the bootstrap peer's address ({dep})")
if "/p2p/bootstrap.addr" not in " ".join(s.get("bootstrap", {}).get("command", [])):
    problems.append("the bootstrap service does not write /p2p/bootstrap.addr for the nodes")
dep = s.get("coordinator", {}).get("depends_on", {}).get("node", {}).get("condition")
if dep != "service_healthy":
    problems.append(f"coordinator does not wait for healthy nodes ({dep})")
mounts = [str(v.get("source") if isinstance(v, dict) else v).split(":")[0]
          for v in node.get("volumes", [])]
if "model" in mounts:
    problems.append("node mounts the whole model volume")
nets = {n for svc in s.values() for n in (svc.get("networks") or {})}
if len(nets) != 1:
    problems.append(f"services are not on one bridge network (mDNS needs one): {nets}")
if problems:
    sys.exit("compose.yaml: " + "; ".join(problems))
PY
    echo "check_compose: $file valid for $v (and NODES=5 scales the nodes)" >&2
done
