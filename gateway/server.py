"""The gateway process: its gRPC door (gateway/grpc_door.py) and browser doors (gateway/web.py) over one registry of
sessions, started after the backends' channels and stopped in order."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.backends import Backends
from gateway.grpc_door import ConversationServicer
from gateway.registry import SessionRegistry
from gateway.settings import GatewaySettings
from gateway.web import WebDoor
from voicemesh import config, serving
from voicemesh.clients import Credentials
from voicemesh.serving import Server
from voicemesh.tls import ClientTls
from voicemesh.v1 import conversation_pb2, conversation_pb2_grpc

__all__ = ["GatewayServer", "GatewaySettings", "build_server", "main"]  # what embedders and tests import from here


class GatewayServer(Server):
    """The gRPC server plus the browser doors' HTTP server, which starts after the backends and stops first."""

    http: WebDoor | None = None
    registry: SessionRegistry | None = None

    @property
    def http_port(self) -> int:
        return self.http.port if self.http is not None else 0

    async def stop(self) -> None:
        """Drain, then stop: NOT_SERVING and no new sessions at once, replies being spoken play to their end
        (within drain_grace_s), and only then are the transports cut."""
        if self.registry is not None:
            await self.set_not_serving()
            await self.registry.drain(self.settings.drain_grace_s)
        if self.http is not None:
            await self.http.stop()
        await super().stop()


def build_server(settings: GatewaySettings) -> GatewayServer:
    """The gateway; `server.servicer` is its SessionRegistry (open sessions, histories) for in-process callers."""
    registry = SessionRegistry(settings)
    servicer = ConversationServicer(registry)
    server: GatewayServer

    async def load() -> None:
        # Channels belong to the serving event loop, so they are made here, not before it runs.
        registry.backends = Backends(
            settings.asr_target, settings.llm_target, settings.tts_target, credentials=service_credentials(settings)
        )
        await registry.backends.start()
        if settings.http_port >= 0:
            server.http = WebDoor(registry, settings)
            await server.http.start(0 if settings.port == 0 else settings.http_port)

    async def unload() -> None:
        if registry.backends is not None:
            await registry.backends.close()

    server = GatewayServer(
        settings,
        [conversation_pb2.DESCRIPTOR.services_by_name["Conversation"].full_name],
        lambda grpc_server: conversation_pb2_grpc.add_ConversationServicer_to_server(servicer, grpc_server),
        load,
        registry,
        unload,
    )
    server.registry = registry
    return server


def service_credentials(settings: GatewaySettings) -> Credentials:
    """How the gateway reaches its services: TLS when given a CA (mutual with a certificate), and their token."""
    tls = None
    if settings.service_tls_ca or settings.service_tls_cert:
        tls = ClientTls(settings.service_tls_ca, settings.service_tls_cert, settings.service_tls_key)
    return Credentials(tls, settings.service_token)


def main(argv: Sequence[str] | None = None) -> None:
    settings = config.from_argv(GatewaySettings, "gateway", argv, prog="voicemesh serve gateway")
    serving.run("gateway", settings, build_server)


if __name__ == "__main__":
    main()
