"""gRPC-Web and the browser page on a second port (`tokenline serve --web-port N`).

The browser calls the *same* servicer instance the gRPC port serves, registered through the same
add-function, so every RPC, the bearer-key auth, deadlines (`grpc-timeout`) and error statuses are
those of the native path. The HTTP/1.1 server is uvicorn, in the gRPC server's own event loop.

sonora (a gRPC-Web ASGI library) gives the wire format: message and trailer framing, the
grpc-web-text variant, `grpc-timeout` parsing and handler registration. Its ASGI call flow is not
used: in 0.2.3 an error after the first streamed message starts a second HTTP response, a
disconnect is only noticed when the next message is sent, the CORS origin echoes the Host header,
and its context lacks the `done()`/`cancelled()` the servicer asks before aborting. `WebGateway`
owns that flow instead: one task per call, cancelled when the caller disconnects or its deadline
passes (what grpc core does on the native port), and errors sent in trailers whenever they happen.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import logging
import pathlib
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from tokenline.engine.flagspec import flag

import grpc
from sonora import protocol
from sonora.asgi import ServicerContext, grpcASGI

log = logging.getLogger("tokenline.web")

# Where `make web` puts the page and its bundle (an editable install: the repository's build/).
DEFAULT_ROOT = pathlib.Path(__file__).resolve().parent.parent / "build" / "web"
NOT_BUILT = b"""<!doctype html><meta charset="utf-8"><title>tokenline</title>
<p>The tokenline page is not built. Run <code>make web</code> (it needs Node.js and npm) and reload.
The gRPC-Web API on this port works without it.</p>
"""
# What a browser page may send and read across origins (with --web-cors-origin).
CORS_REQUEST_HEADERS = b"authorization, content-type, grpc-timeout, x-grpc-web, x-user-agent, connect-protocol-version"
CORS_EXPOSE_HEADERS = b"grpc-status, grpc-message, grpc-status-details-bin, grpc-retry-pushback-ms"
# grpc-message is percent-encoded: everything printable but '%' stays as it is (the gRPC spec).
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)


@dataclass(frozen=True)
class WebConfig:
    port: int = flag(0, "--web-port", "serve gRPC-Web (the same API, keys and deadlines) and the browser page on "
                     "this port, on --host (0 picks a free one; default off)", type=int)
    host: str = "127.0.0.1"
    cors_origin: str | None = flag(None, "--web-cors-origin", "let pages from ORIGIN (e.g. https://app.example.com, "
                                   "or *) call the gRPC-Web port (default: only the page the port serves itself)",
                                   metavar="ORIGIN")
    root: str | None = flag(None, "--web-root", "folder of the page's files (index.html, app.js, style.css), read "
                            "at start (default: the build/web that `make web` writes)", metavar="DIR")
    max_message_bytes: int = 4 * 1024 * 1024
    tls_cert: str | None = None
    tls_key: str | None = None
    # A request's head, and then its body, must each arrive within this: a connection that sends nothing
    # (or a head a byte at a time) is closed, a body that trickles gets 408. Idle keep-alive: uvicorn's 5 s.
    read_timeout_s: float = flag(15.0, "--web-read-timeout-s", "a request's head, then its body, must each arrive "
                                 "within this on the web port: a connection that sends nothing (or a byte at a "
                                 "time) is closed, a trickling body gets 408")
    # Connections (and requests) at once on the web port; beyond, new requests get 503 at once.
    max_connections: int = flag(4096, "--web-max-connections", "connections and requests at once on the web port; "
                                "beyond, requests get 503 at once")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--web-port must be in 0..65535, got {self.port}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"--web-read-timeout-s must be positive, got {self.read_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"--web-max-connections must be at least 1, got {self.max_connections}")


class WebContext(ServicerContext):
    """sonora's context plus what the servicer asks of a grpc.aio context."""

    def __init__(self, timeout: float | None, metadata: list, peer: str):
        super().__init__(timeout, metadata, enable_cors=False)
        self._peer = peer
        self._done = False
        self._cancelled = False

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict:
        return {}  # no client certificates over gRPC-Web: callers authenticate with bearer keys


class WebGateway(grpcASGI):
    """An ASGI app: gRPC-Web calls to the registered handlers; GET serves the page's files."""

    def __init__(self, config: WebConfig, files: dict[str, tuple[bytes, str]]):
        super().__init__(application=None, enable_cors=False)
        self.config = config
        self.files = files
        self.openai = None  # the OpenAI-compatible /v1 routes (server/openai_api.py), once a servicer is given

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict) -> None:
        # Generated add-functions (grpcio >= 1.62) also call this; the generic handler they register suffices.
        pass

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method == "POST":
            refusal = self._refusal(scope, path)
            if refusal is not None:
                return await _plain(send, refusal[0], self._cors_headers(scope), refusal[1])
        if self.openai is not None and path.startswith("/v1/"):
            return await self.openai(scope, receive, send)
        handler = self._get_rpc_handler(path)
        if method == "OPTIONS":
            await self._preflight(scope, send)
        elif handler is not None and method == "POST":
            await self._call(handler, scope, receive, send)
        elif handler is None and method in ("GET", "HEAD"):
            await self._file(path, method, send)
        else:
            await _plain(send, 405 if handler is not None else 404, self._cors_headers(scope))

    # ------------------------------------------------------------------ calls

    async def _call(self, handler: grpc.RpcMethodHandler, scope, receive, send) -> None:
        headers = [(k.decode("latin-1"), v) for k, v in scope["headers"]]
        client = scope.get("client") or ("", 0)
        try:
            timeout = next((_grpc_timeout(v) for k, v in headers if k == "grpc-timeout"), None)
            metadata = [(k, _metadata_value(k, v)) for k, v in headers if k != "grpc-timeout"]
            bad = None
        except ValueError as err:
            timeout, metadata, bad = None, [(k, v.decode("latin-1")) for k, v in headers if k == "content-type"], str(err)
        if not any(k == "host" for k, _ in metadata):  # sonora's context needs it; HTTP/1.1 always sends it
            metadata.append(("host", scope.get("server", ("localhost",))[0]))
        context = WebContext(timeout, metadata, f"ipv4:{client[0]}:{client[1]}")
        reply = _Reply(send, context, self._cors_headers(scope))
        if bad is not None:
            return await reply.end(grpc.StatusCode.INVALID_ARGUMENT, bad)
        if handler.request_streaming:
            return await reply.end(grpc.StatusCode.UNIMPLEMENTED, "client streaming is not offered over gRPC-Web")
        request = await self._read_request(receive, context, reply)
        if request is None:
            return
        work = asyncio.ensure_future(self._respond(handler, handler.request_deserializer(request), context, reply))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the caller went away: stop its call, as grpc core does
                context._cancelled = True
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        finally:
            watch.cancel()
            context._done = True

    async def _read_request(self, receive, context: WebContext, reply: _Reply) -> bytes | None:
        """The one request message (empty if the body has none), or None after answering an error."""
        body = bytearray()
        limit = self.config.max_message_bytes + 5
        text = context._unwrap_message is protocol.b64_unwrap_message_asgi
        while True:
            try:
                async with asyncio.timeout(self.config.read_timeout_s):
                    event = await receive()
            except TimeoutError:
                await reply.end(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the request body did not arrive within {self.config.read_timeout_s:g} s")
                return None
            if event["type"] == "http.disconnect":
                return None
            body += event.get("body", b"")
            if len(body) > (limit * 4 // 3 + 4 if text else limit):
                await reply.end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the request is larger than {self.config.max_message_bytes} bytes")
                return None
            if not event.get("more_body"):
                break
        if not body:
            return b""
        try:
            _, compressed, message = protocol.b64_unwrap_message(bytes(body)) if text else protocol.unwrap_message(bytes(body))
        except Exception:
            await reply.end(grpc.StatusCode.INVALID_ARGUMENT, "the request body is not a gRPC-Web message frame")
            return None
        if compressed:
            await reply.end(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported")
            return None
        return bytes(message)

    async def _respond(self, handler: grpc.RpcMethodHandler, request, context: WebContext, reply: _Reply) -> None:
        code, details = grpc.StatusCode.OK, None
        try:
            async with asyncio.timeout(context.time_remaining()):
                if handler.response_streaming:
                    async for message in handler.unary_stream(request, context):
                        await reply.message(handler.response_serializer(message))
                else:
                    message = await handler.unary_unary(request, context)
                    await reply.message(handler.response_serializer(message))
            code, details = context.code, context.details
        except grpc.RpcError:  # context.abort
            code, details = context.code, context.details
        except TimeoutError:
            context._cancelled = True
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except Exception:
            log.exception("gRPC-Web call failed")
            code, details = grpc.StatusCode.UNKNOWN, "Unexpected error in the server"
        await reply.end(code, details)

    # ------------------------------------------------------------------ who may call

    def _refusal(self, scope, path: str) -> tuple[int, str] | None:
        """Why a POST is refused before it runs, or None. A browser sends a cross-site "simple" request
        (a form's content type, no preflight) wherever a page tells it to; these rules keep such a
        request, and a DNS-rebound one, from running anything:
        - the content type is the API's own (gRPC-Web, or JSON on /v1/), which no simple request has;
        - an Origin, when sent, is this server's own or the one --web-cors-origin allows;
        - on a loopback address, the Host names a loopback address (a rebound name does not)."""
        headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in (b"content-type", b"origin", b"host")}
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        wanted = ("application/json",) if path.startswith("/v1/") else _GRPC_WEB_TYPES
        if kind not in wanted:
            return 415, f"content-type {kind or '(none)'!r} is not accepted here; send {' or '.join(wanted)}"
        host = headers.get("host", "")
        if self._loopback and not _is_loopback(_hostname(host)):
            return 403, (f"Host {host[:100]!r} is not this server's name: it listens on a loopback address, "
                         "so only localhost, 127.0.0.1 and [::1] name it")
        origin = headers.get("origin")
        allowed = self.config.cors_origin
        if origin is not None and origin != "null" and urlsplit(origin).netloc != host \
                and allowed != "*" and origin != allowed:
            return 403, (f"a call from the page at {origin[:100]!r} (another site) is refused; "
                         "to allow it, start the server with --web-cors-origin set to that origin")
        if origin == "null" and allowed != "*":
            return 403, "a call from a page with no origin (a file or a sandbox) is refused"
        return None

    @property
    def _loopback(self) -> bool:
        return _is_loopback(_hostname(self.config.host))

    # ------------------------------------------------------------------ page and CORS

    async def _file(self, path: str, method: str, send) -> None:
        found = self.files.get("/index.html" if path == "/" else path)
        if found is None:
            if path != "/":
                return await _plain(send, 404)
            found = (NOT_BUILT, "text/html; charset=utf-8")
        body, kind = found
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", kind.encode()), (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-cache")]})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})

    def _cors_headers(self, scope) -> list[tuple[bytes, bytes]]:
        allowed = self.config.cors_origin
        if not allowed:
            return []
        origin = next((v for k, v in scope["headers"] if k == b"origin"), None)
        if allowed != "*" and origin != allowed.encode():
            return []
        return [(b"access-control-allow-origin", allowed.encode() if allowed == "*" else origin),
                (b"access-control-expose-headers", CORS_EXPOSE_HEADERS), (b"vary", b"origin")]

    async def _preflight(self, scope, send) -> None:
        headers = self._cors_headers(scope)
        if headers:
            headers += [(b"access-control-allow-methods", b"POST, OPTIONS"),
                        (b"access-control-allow-headers", CORS_REQUEST_HEADERS), (b"access-control-max-age", b"600")]
        await _plain(send, 204 if headers else 403, headers)


class _Reply:
    """One call's response: headers with the first message, then messages, then the trailers."""

    def __init__(self, send, context: WebContext, extra_headers: list[tuple[bytes, bytes]]):
        self.send, self.context, self.extra = send, context, extra_headers
        self.started = False

    def _headers(self) -> list[tuple[bytes, bytes]]:
        kind = b"application/grpc-web-text" if self.context._wrap_message is protocol.b64_wrap_message else b"application/grpc-web+proto"
        return [(b"content-type", kind), *(self.context._initial_metadata or ()), *self.extra]

    async def message(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            await self.send({"type": "http.response.start", "status": 200, "headers": self._headers()})
        await self.send({"type": "http.response.body", "body": self.context._wrap_message(False, False, data), "more_body": True})

    async def end(self, code: grpc.StatusCode, details: str | None) -> None:
        status = [("grpc-status", str(code.value[0]))]
        if details:
            status.append(("grpc-message", quote(details, safe=_MESSAGE_SAFE)))
        status += list(self.context._trailing_metadata or ())
        if not self.started:  # trailers-only: the status travels in the headers
            self.started = True
            headers = self._headers() + [(k.encode(), v.encode()) for k, v in status]
            await self.send({"type": "http.response.start", "status": 200, "headers": headers})
            await self.send({"type": "http.response.body", "body": b""})
            return
        trailers = self.context._wrap_message(True, False, protocol.pack_trailers(status))
        await self.send({"type": "http.response.body", "body": trailers, "more_body": False})


def _metadata_value(key: str, value: bytes):
    """A header as gRPC metadata: "-bin" values are base64 (padded or not); ValueError if not."""
    if not key.endswith("-bin"):
        return value.decode("latin-1")
    try:
        return base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"header {key[:60]!r} ends in -bin but its value is not base64") from None


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _plain(send, status: int, headers: list[tuple[bytes, bytes]] = (), text: str = "") -> None:
    body = (text + "\n").encode() if text else b""
    kind = [(b"content-type", b"text/plain; charset=utf-8")] if text else []
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, *kind, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


_GRPC_WEB_TYPES = ("application/grpc-web", "application/grpc-web+proto", "application/grpc-web-text",
                   "application/grpc-web-text+proto")
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def _is_loopback(name: str) -> bool:
    if name in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _grpc_timeout(value: bytes) -> float:
    """grpc-timeout as the gRPC spec writes it (1 to 8 digits, then H M S m u n), in seconds; ValueError otherwise."""
    text = value.decode("latin-1")
    if not (2 <= len(text) <= 9 and text[:-1].isdigit() and text[:-1].isascii() and text[-1] in _TIMEOUT_UNITS):
        raise ValueError(f"grpc-timeout {text[:20]!r} is not a gRPC timeout: 1 to 8 digits and a unit (H, M, S, m, u, n)")
    return int(text[:-1]) * _TIMEOUT_UNITS[text[-1]]


def _hostname(host: str) -> str:
    """The name in a Host header or a bind address, without port or brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


__all__ = ["WebConfig", "WebContext", "WebGateway"]
