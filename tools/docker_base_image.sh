#!/usr/bin/env bash
# Make sure the Dockerfile's base image (python:3.11-slim) is in the local Docker engine:
# kept from an earlier run, else pulled, else built as a stand-in where no registry serves it.
#
# The stand-in is Debian bookworm (whose Python is 3.11) as the official image has it:
#   a minbase root file system made by debootstrap from the mirror apt uses here, `docker
#   import`ed, with python3, python3-pip and python3-venv, `python` linked to python3 and
#   /usr/lib/python3.11/EXTERNALLY-MANAGED removed (so `pip install .` works as in the official
#   image). It carries this host's CA bundle, with PIP_CERT/SSL_CERT_FILE/REQUESTS_CA_BUNDLE
#   set to it: where registries are reached through a TLS-intercepting proxy, that proxy's CA
#   is only in the host bundle, and pip in the build would fail with CERTIFICATE_VERIFY_FAILED.
# The image is tagged python:3.11-slim so the Dockerfile's FROM works unchanged; it stays
# cached for the next run (`docker rmi python:3.11-slim` drops it).
#
# Usage: tools/docker_base_image.sh [IMAGE]   (root; Docker engine running)
set -euo pipefail
image=${1:-python:3.11-slim}
suite=bookworm

if docker image inspect "$image" >/dev/null 2>&1; then
    echo "base image: $image present ($(docker image inspect -f '{{.Comment}}' "$image"))"
    exit 0
fi
if timeout 180 docker pull -q "$image"; then
    echo "base image: $image pulled"
    exit 0
fi
echo "base image: $image cannot be pulled here; building a Debian $suite stand-in"
[[ $image == python:3.11* ]] || { echo "base image: no stand-in for $image" >&2; exit 2; }

# The mirror apt uses (deb822 .sources or one-line sources.list); debootstrap's wget honours
# the same proxy as apt when apt has one configured (Acquire::http::Proxy).
mirror=$(awk '/^URIs:/ {u=$2} /^Suites:/ && $0 ~ / '"$suite"'( |$)/ {print u; exit}' \
    /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
if [[ -z $mirror ]]; then
    mirror=$(awk '$1 == "deb" && $3 == "'"$suite"'" {print $2; exit}' \
        /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}
proxy=$(apt-config dump 2>/dev/null | sed -n 's/^Acquire::http::Proxy "\(.*\)";$/\1/p' | head -1)
if [[ -n $proxy && -z ${http_proxy:-} ]]; then
    export http_proxy=$proxy
fi
echo "base image: mirror $mirror${http_proxy:+ via proxy $http_proxy}"

if ! command -v debootstrap >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq debootstrap >/dev/null \
        || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
fi

root=$(mktemp -d /var/tmp/moeshard-base.XXXXXX)
trap 'rm -rf "$root" "$root.log"' EXIT
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
    "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -20 "$root.log" >&2; echo "base image: debootstrap failed" >&2; exit 1; }
rm -f "$root.log"

rm -f "$root/usr/lib/python3.11/EXTERNALLY-MANAGED"
ln -sf python3 "$root/usr/bin/python"
host_ca=/etc/ssl/certs/ca-certificates.crt
bundle=/usr/local/share/ca-bundle-host.crt  # a path update-ca-certificates never rewrites
if [[ -f $host_ca ]]; then
    cp "$host_ca" "$root$bundle"
else
    cp "$root/etc/ssl/certs/ca-certificates.crt" "$root$bundle"
fi
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/*

tar -C "$root" --numeric-owner -c . | docker import \
    -m "moeshard stand-in for $image: debootstrap $suite minbase + python3 ($0)" \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' \
    -c "ENV PIP_CERT=$bundle" \
    -c "ENV SSL_CERT_FILE=$bundle" \
    -c "ENV REQUESTS_CA_BUNDLE=$bundle" \
    -c 'CMD ["python3"]' \
    - "$image" >/dev/null
docker run --rm "$image" python -c 'import sys, venv; print("base image: python", sys.version[:6])'
echo "base image: $image built ($(docker image inspect -f '{{.Size}}' "$image" | numfmt --to=iec))"
