"""Numbers both ends of the wire agree on (the node daemon and the coordinator's client)."""

WIRE_VERSION = 1  # the moeshard.v1 contract (proto/moeshard.proto); bumped on a breaking change
MAX_MESSAGE_BYTES = 256 << 20  # gRPC message size limit, both directions
MAX_ROWS = 1 << 16  # rows of one Forward call (a node's --max-rows may be lower)
MAX_ACTIVATION = 1e30  # largest |value| a node sends as a result; beyond: INVALID_ARGUMENT
MAX_SLOTS = 256  # expert slots per row of one Forward call
MAX_BLOCKS = 64  # blocks one possession challenge may ask for (rpc Prove)
MAX_RECORDS = 16  # distinct expert records one possession challenge may make a node read
CREDIT_CAP = 2 << 30  # record bytes of credit a client may hold on a node (node/limits.py)
SERVICE_TYPE = "_moeshard._tcp.local."  # zeroconf (DNS-SD) service type of expert nodes
