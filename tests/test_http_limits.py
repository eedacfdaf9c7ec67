"""The web port under connections that send nothing, or a byte at a time: they are closed or refused on a
deadline, and meanwhile everyone else is served on both ports (the simulated engine: this is about the door)."""

from __future__ import annotations

import socket
import time
import urllib.parse

import httpx
import pytest

from tokenline.client import Client
from tests.support import ServerProcess, wait_until

READ_TIMEOUT_S = 2.0
IDLE = 2000


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--max-seqs", "8", "--web-port", "0",
                      "--web-read-timeout-s", str(READ_TIMEOUT_S)).start()
    yield s
    s.stop()


def _connect(url: str) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _chat(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny-llama", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})


def test_two_thousand_idle_connections_cost_nobody_else_and_are_closed_on_the_deadline(server):
    idle = [_connect(server.web_url) for _ in range(IDLE)]
    try:
        opened = time.monotonic()
        # Everyone else is served meanwhile, through both doors of the web port and the gRPC port.
        assert _chat(server.web_url).json()["usage"]["completion_tokens"] == 8
        with Client(server.address) as client:
            assert client.complete("hello", max_tokens=8).usage.completion_tokens == 8
        assert httpx.get(server.web_url + "/v1/models", timeout=30).status_code == 200
        wait = READ_TIMEOUT_S - (time.monotonic() - opened) + 3.0
        # all() stops at the first one still open: each waits at most the time left.
        assert all(_closed_by_server(s, max(wait, 0.1) if i == 0 else 0.5) for i, s in enumerate(idle))
    finally:
        for s in idle:
            s.close()
    assert _chat(server.web_url).status_code == 200


def test_a_head_sent_a_byte_at_a_time_is_cut_off(server):
    sock = _connect(server.web_url)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\nx-slow: " + b"a" * 200
    started = time.monotonic()
    cut = False
    try:
        for byte in head:
            sock.sendall(bytes([byte]))
            time.sleep(0.05)
            if time.monotonic() - started > READ_TIMEOUT_S + 5:
                break
    except (BrokenPipeError, ConnectionResetError):
        cut = True
    cut = cut or _closed_by_server(sock, 5)
    sock.close()
    assert cut and time.monotonic() - started < READ_TIMEOUT_S + 8


def _content_length(answer: bytes) -> int:
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    return next((int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.startswith("content-length:")), 0)


def test_a_body_that_trickles_gets_408_and_a_body_that_never_ends_does_not_hold_the_door(server):
    sock = _connect(server.web_url)
    body = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}'
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
    sock.settimeout(0.5)
    answer = b""
    for byte in body:
        try:
            sock.sendall(bytes([byte]))
            answer += sock.recv(4096)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if answer:
            break
    # The answer's head and body may come in separate packets: read to its length, or to the close.
    sock.settimeout(2.0)
    while b"\r\n\r\n" in answer and len(answer.split(b"\r\n\r\n", 1)[1]) < _content_length(answer):
        try:
            more = sock.recv(4096)
        except (TimeoutError, ConnectionResetError):
            break
        if not more:
            break
        answer += more
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"did not arrive within" in answer
    assert _chat(server.web_url).status_code == 200


@pytest.fixture(scope="module")
def full_server():
    # One slot, one queued request, 20 ms steps: a third long request at once finds the queue full.
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--workers", "1", "--max-seqs", "1", "--interactive-slots", "0",
                      "--queue-requests", "1", "--sim-step-ms", "20", "--web-port", "0").start()
    yield s
    s.stop()


def test_a_full_queue_is_429_with_retry_after_and_a_passed_deadline_is_504(full_server):
    import concurrent.futures

    body = {"model": "tiny-llama", "max_tokens": 100, "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]}
    url = full_server.web_url + "/v1/chat/completions"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(httpx.post, url, json=body, timeout=60) for _ in range(2)]
        # Both in, one running and one queued: the slot and the queue are taken (asked, not guessed from a wait).
        with Client(full_server.address) as client:
            assert wait_until(lambda: (lambda m: m.running + m.queued_interactive + m.queued_bulk == 2)(
                client.list_models(timeout=10)[0]), timeout=60)
        refused = httpx.post(url, json=body, timeout=60)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["type"] == "rate_limit_error"
        assert [f.result().status_code for f in running] == [200, 200]
    late = httpx.post(url, json=body | {"max_tokens": 500}, headers={"X-Tokenline-Deadline-Ms": "300"}, timeout=60)
    assert late.status_code == 504 and "deadline" in late.json()["error"]["message"], late.text


def test_a_late_interactive_request_refused_is_429_with_retry_after_streamed_or_not():
    """`--late-interactive refuse`, an ITL target of one single step: beside a running stream there is no room, so a
    chat is refused once its 300 ms TTFT target is out of reach, before any byte of a response (even a stream)."""
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--sim-step-ms", "20", "--late-interactive", "refuse",
                      "--interactive-itl-target-steps", "1", "--interactive-ttft-target-ms", "300", "--web-port", "0").start()
    try:
        with Client(s.address) as client:
            holder = client.generate("holds the room", max_tokens=1500, ignore_eos=True)
            for n, _ in enumerate(holder):  # the worker has measured its single step
                if n == 30:
                    break
            body = {"model": "tiny-llama", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            plain = httpx.post(s.web_url + "/v1/chat/completions", json=body, timeout=30)
            with httpx.stream("POST", s.web_url + "/v1/chat/completions", json=body | {"stream": True}, timeout=30) as r:
                streamed = (r.status_code, r.headers.get("retry-after"), r.read())
            holder.cancel()
        assert plain.status_code == 429 and plain.json()["error"]["type"] == "rate_limit_error", plain.text
        assert "TTFT target" in plain.json()["error"]["message"] and int(plain.headers["retry-after"]) >= 1
        assert streamed[0] == 429 and int(streamed[1]) >= 1 and b"TTFT target" in streamed[2], streamed
    finally:
        s.stop()


# ------------------------------------------------------------------ who may call

def _grpc_web(url: str, method: str, body: bytes, **headers) -> httpx.Response:
    return httpx.post(url + "/tokenline.v1.Tokenline/" + method, content=body, timeout=30,
                      headers={"content-type": "application/grpc-web+proto", "x-grpc-web": "1", **headers})


LIST_MODELS = b"\x00\x00\x00\x00\x00"  # an empty ListModelsRequest, framed


@pytest.mark.parametrize("path, headers, status, words", [
    # What a page on another site can make a browser send without asking first (a "simple" request).
    ("/tokenline.v1.Tokenline/ListModels", {"content-type": "text/plain", "origin": "http://evil.example"}, 415, "content-type"),
    ("/v1/completions", {"content-type": "text/plain", "origin": "http://evil.example"}, 415, "application/json"),
    ("/v1/completions", {"content-type": "application/x-www-form-urlencoded"}, 415, "application/json"),
    # The API's own content type, but from another site's page (it would have needed --web-cors-origin).
    ("/tokenline.v1.Tokenline/ListModels", {"content-type": "application/grpc-web+proto", "origin": "http://evil.example"}, 403, "--web-cors-origin"),
    ("/v1/completions", {"content-type": "application/json", "origin": "http://evil.example"}, 403, "--web-cors-origin"),
    # A name rebound to 127.0.0.1: the browser thinks it is the attacker's own site.
    ("/v1/completions", {"content-type": "application/json", "host": "evil.example:80", "origin": "http://evil.example:80"}, 403, "Host"),
])
def test_cross_site_and_rebound_calls_are_refused_before_they_run(server, path, headers, status, words):
    body = LIST_MODELS if "Tokenline" in path else b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}'
    r = httpx.post(server.web_url + path, content=body, headers=headers, timeout=30)
    assert r.status_code == status and words in r.text, (r.status_code, r.text)


def test_a_page_of_this_server_itself_may_call(server):
    origin = server.web_url.rstrip("/")
    r = _grpc_web(server.web_url, "ListModels", LIST_MODELS, origin=origin)
    assert r.status_code == 200 and r.headers.get("grpc-status", "0") == "0"
    r = httpx.post(server.web_url + "/v1/completions", timeout=30, headers={"origin": origin},
                   json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("headers, words", [
    ({"grpc-timeout": "abc"}, "grpc-timeout"),
    ({"grpc-timeout": "5Z"}, "grpc-timeout"),
    ({"grpc-timeout": "123456789S"}, "grpc-timeout"),
    ({"x-trace-bin": "%%%not base64"}, "base64"),
])
def test_malformed_grpc_headers_are_invalid_argument_not_a_server_error(server, headers, words):
    r = _grpc_web(server.web_url, "ListModels", LIST_MODELS, **headers)
    assert r.status_code == 200, r.text
    assert r.headers["grpc-status"] == "3" and words in urllib.parse.unquote(r.headers["grpc-message"])
    assert "Traceback" not in server.output()
