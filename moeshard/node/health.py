"""grpc.health.v1 for the node: `moeshard health`, Docker's health checks and any gRPC
health prober see one status for the whole server."""

from __future__ import annotations

import threading

import grpc

from moeshard.moe.wire import health_pb2, health_pb2_grpc
from moeshard.node.limits import Limits

SERVICE = "moeshard.v1.ExpertNode"


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: one status for the whole server (service "" and "moeshard.v1.ExpertNode").
    A Watch holds a server thread while open: at most `max_watches` are open at once."""

    SERVICES = ("", SERVICE)

    def __init__(self, max_watches: int = Limits.max_watches):
        self.status = health_pb2.HealthCheckResponse.NOT_SERVING
        self.changed = threading.Condition()
        self.max_watches = max_watches
        self.watches = threading.BoundedSemaphore(max_watches)

    def set_serving(self, serving: bool) -> None:
        with self.changed:
            self.status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            self.changed.notify_all()

    def Check(self, request, context):
        if request.service not in self.SERVICES:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=self.status)

    def Watch(self, request, context):
        if request.service not in self.SERVICES:
            yield health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            )
            return
        if not self.watches.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.max_watches} health watches open already: use Check",
            )
        try:
            last = None
            while context.is_active():
                with self.changed:
                    if self.status == last:
                        self.changed.wait(timeout=1.0)
                        continue
                    last = self.status
                yield health_pb2.HealthCheckResponse(status=last)
        finally:
            self.watches.release()
