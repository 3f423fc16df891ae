"""Numbers both ends of the wire agree on (the node daemon and the coordinator's client)."""

WIRE_VERSION = 1  # the moeshard.v1 contract (proto/moeshard.proto); bumped on a breaking change
MAX_MESSAGE_BYTES = 256 << 20  # gRPC message size limit, both directions
MAX_ROWS = 1 << 16  # rows of one Forward call
MAX_SLOTS = 256  # expert slots per row of one Forward call
SERVICE_TYPE = "_moeshard._tcp.local."  # zeroconf (DNS-SD) service type of expert nodes
