# moeshard: one image for every role of the compose swarm (prep, node, coordinator).
#   docker build -t moeshard .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NUMBA_CACHE_DIR=/var/cache/numba

WORKDIR /app
# The package first (dependencies change rarely), then the demo inputs and the role scripts.
COPY pyproject.toml README.md ./
COPY moe moe
COPY node node
COPY coordinator coordinator
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /app moeshard \
    && mkdir -p /data /shards /claims /checkpoints "$NUMBA_CACHE_DIR" \
    && python -c "from moe import quant; quant.warmup()" \
    && chown -R moeshard /data /shards /claims "$NUMBA_CACHE_DIR"
# The numba kernels are compiled above into $NUMBA_CACHE_DIR; numba recompiles (once, into the
# same directory) only when the host CPU differs from the build machine's.

# Demo inputs: the trained demo checkpoint when the repo has it, else the tiny test fixture.
COPY models models
COPY tests/fixtures/qwen3_moe fixtures/qwen3_moe
COPY docker/prep.sh docker/node.sh /usr/local/bin/
RUN chmod 755 /usr/local/bin/prep.sh /usr/local/bin/node.sh

USER moeshard
EXPOSE 50051
CMD ["moeshard", "--help"]
