"""moeshard's shared core.

Importing it sets grpcio's TLS 1.2 cipher list (see `TLS12_CIPHER_SUITES`) before grpc is
loaded: grpcio reads `GRPC_SSL_CIPHER_SUITES` once, when it is imported, and its Python API
has no other TLS version setting (grpc/grpc#37305). The `coordinator` and `node` packages
import this package first, so the setting is in place whichever entry point runs.
"""

import os

# Only RSA-signed TLS 1.2 suites. Every moeshard TLS key is ECDSA P-256 (moe/identity/tls.py),
# so no TLS 1.2 handshake can complete with one (NO_SHARED_CIPHER), whatever the client offers;
# BoringSSL does not take TLS 1.3 suites from this list, so TLS 1.3 is untouched. The node
# checks at start that it holds (moe.identity.tls.accepts_tls12).
TLS12_CIPHER_SUITES = "ECDHE-RSA-AES128-GCM-SHA256:ECDHE-RSA-AES256-GCM-SHA384"
os.environ["GRPC_SSL_CIPHER_SUITES"] = TLS12_CIPHER_SUITES

# gRPC core's own log: errors only unless the user asks for more (GRPC_VERBOSITY=INFO/DEBUG).
# At its default a node logged a line for every failed TLS handshake, its own TLS 1.2 check at
# start included: a stranger could fill the node's log by opening connections.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
