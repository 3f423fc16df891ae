"""moeshard: mixture-of-experts models larger than RAM, their experts streamed from SSD or
computed by a network of nodes.

The parts, each a package of its own (docs/architecture.md has the map):

- `moeshard.moe`: the shared core (model families, the experts interface, storage and O_DIRECT
  reads, kernels, conversion, the wire format, identities, the ledger);
- `moeshard.node`: the storage node's daemon (gRPC servicer, limits, announcements);
- `moeshard.coordinator`: one generation's runtime, the network client with its trust layer,
  the OpenAI-compatible server;
- `moeshard.bench`: the benchmarks (`moeshard bench ...`);
- `moeshard.cli`, `moeshard.commands`: the command line.
"""

from moeshard import moe as _moe  # noqa: F401  (first: grpcio's TLS policy, see moeshard.moe)
