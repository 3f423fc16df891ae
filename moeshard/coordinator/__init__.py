import moeshard.moe  # noqa: F401  (first: sets grpcio's TLS policy before grpc is imported)
