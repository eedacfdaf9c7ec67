"""The web port's HTTP server: uvicorn serving the gRPC-Web gateway (server/web.py) and the page's files, started
and stopped from the gRPC server's event loop, with a deadline on each request head.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import pathlib
import socket

from tokenline.server.web import DEFAULT_ROOT, WebConfig, WebGateway

log = logging.getLogger("tokenline.web")


def load_files(root: pathlib.Path) -> dict[str, tuple[bytes, str]]:
    """The page's files by URL path (blocking: call it off the event loop). Empty if it is not built."""
    files = {}
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if path.is_file():
                kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
                if kind.startswith("text/") or kind.endswith("javascript"):
                    kind += "; charset=utf-8"
                files["/" + path.name] = (path.read_bytes(), kind)
    return files


class WebServer:
    """uvicorn serving a `WebGateway`, started and stopped from the gRPC server's event loop.

    Register services on `gateway` (as on a grpc server) before `start`."""

    def __init__(self, config: WebConfig):
        self.config = config
        self.gateway = WebGateway(config, {})
        self.port: int | None = None
        self._server = None

    async def start(self) -> int:
        """Bind (raises OSError if the port is taken) and serve; returns the port."""
        import uvicorn

        root = pathlib.Path(self.config.root) if self.config.root else DEFAULT_ROOT
        self.gateway.files = await asyncio.to_thread(load_files, root)
        if "/index.html" not in self.gateway.files:
            log.warning("the web page is not built (%s has no index.html): run `make web`; gRPC-Web works without it", root)
        sock = socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        # Started by hand, not with Server.serve(): that would take over SIGTERM and SIGINT from the gRPC server.
        config = uvicorn.Config(self.gateway, lifespan="off", log_level="warning", access_log=False,
                                ssl_certfile=self.config.tls_cert, ssl_keyfile=self.config.tls_key,
                                timeout_graceful_shutdown=1, limit_concurrency=self.config.max_connections)
        config.load()
        config.http_protocol_class = head_deadline(config.http_protocol_class, self.config.read_timeout_s)
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)
        await self._server.startup(sockets=[sock])
        return self.port

    async def stop(self) -> None:
        if self._server is not None and self._server.started:
            await self._server.shutdown()


def head_deadline(protocol_class: type, timeout_s: float) -> type:
    """uvicorn's HTTP protocol, closing a connection whose request head has not all arrived within `timeout_s`
    of its first byte or of the connection's opening (uvicorn itself waits forever for a first request, and for
    a head sent a byte at a time: a few thousand such connections would hold as many sockets for good)."""

    class HeadDeadline(protocol_class):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:  # noqa: ANN001
            super().connection_made(transport)
            self._seen_cycle = None
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._seen_cycle:  # a head arrived whole
                self._seen_cycle = self.cycle
                if self._head_timer is not None:
                    self._head_timer.cancel()
                    self._head_timer = None
            elif self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._head_timer = self.loop.call_later(timeout_s, self._head_late)  # a next head began

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.cycle is self._seen_cycle and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

    return HeadDeadline


__all__ = ["WebServer", "head_deadline", "load_files"]
