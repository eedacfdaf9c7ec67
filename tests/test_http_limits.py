"""The web port under connections that send nothing, or a byte at a time: they are closed or refused on a
deadline, and meanwhile everyone else is served on both ports (the simulated engine: this is about the door)."""

from __future__ import annotations

import socket
import time
import urllib.parse

import httpx
import pytest

from tokenline.client import Client
from tests.support import ServerProcess

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
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\nx-slow: " + b"a" * 200
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


def test_a_body_that_trickles_gets_408_and_a_body_that_never_ends_does_not_hold_the_door(server):
    sock = _connect(server.web_url)
    body = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}'
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
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
        time.sleep(0.5)  # both admitted or queued: the slot and the queue are taken
        refused = httpx.post(url, json=body, timeout=60)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["type"] == "rate_limit_error"
        assert [f.result().status_code for f in running] == [200, 200]
    late = httpx.post(url, json=body | {"max_tokens": 500}, headers={"X-Tokenline-Deadline-Ms": "300"}, timeout=60)
    assert late.status_code == 504 and "deadline" in late.json()["error"]["message"], late.text
