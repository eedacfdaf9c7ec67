"""gRPC-Web on the same server (`--web-port`): the wire (statuses, deadlines, auth, CORS), the browser
page in headless Chromium, and the Node client example on its generated @grpc/grpc-js stub.

The page and the Node client are built by `make web`; Chromium is Debian's, installed by `make test`.
"""

from __future__ import annotations

import json
import os
import re
import pathlib
import shutil
import struct
import subprocess
import sys
from urllib.parse import unquote

import httpx
import pytest

from tests.support import ServerProcess
from tests.test_auth import write_keys
from tokenline.v1 import tokenline_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM = pathlib.Path("/usr/bin/chromium")
NODE = shutil.which("node")
SERVICE = "/tokenline.v1.Tokenline/"
KEY = "tk-web-test-key-0123456789"
HEADERS = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1"}


def frame(message) -> bytes:
    data = message.SerializeToString()
    return struct.pack(">BI", 0, len(data)) + data


def call(base: str, method: str, body: bytes, headers: dict | None = None, timeout: float = 120.0):
    """One gRPC-Web call: (response messages, status dict with grpc-status and grpc-message)."""
    r = httpx.post(base + SERVICE + method, content=body, headers={**HEADERS, **(headers or {})}, timeout=timeout)
    assert r.status_code == 200, r.text
    messages, status, at = [], {}, 0
    content = r.content
    while at < len(content):
        flags, n = struct.unpack(">BI", content[at:at + 5])
        data, at = content[at + 5:at + 5 + n], at + 5 + n
        if flags & 0x80:
            for line in data.decode().split("\r\n"):
                if line:
                    k, _, v = line.partition(":")
                    status[k.strip().lower()] = v.strip()
        else:
            messages.append(data)
    if not status:  # trailers-only: the status came in the headers
        status = {k: v for k, v in r.headers.items() if k.startswith("grpc-")}
    status["grpc-message"] = unquote(status.get("grpc-message", ""))
    return messages, status


def generate(max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="The sea is", sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))


# ------------------------------------------------------------------ the wire, real engine

@pytest.mark.engine
def test_a_stream_over_grpc_web_is_contiguous_and_ends_with_the_servers_split(tiny_server):
    messages, status = call(tiny_server.web_url, "Generate", frame(generate(12, temperature=0)))
    assert status["grpc-status"] == "0", status
    chunks = [pb.GenerateChunk.FromString(m) for m in messages]
    index = 0
    for chunk in chunks:
        assert chunk.index == index
        index += len(chunk.token_ids)
    assert index == 12
    final = chunks[-1]
    assert final.finish_reason == pb.LENGTH and final.usage.completion_tokens == 12
    assert final.timeline.HasField("first_token_ms") and final.timeline.completion_ms > 0
    # The unary RPC rides the same path.
    messages, status = call(tiny_server.web_url, "Complete", frame(generate(5, temperature=0)))
    assert status["grpc-status"] == "0" and len(pb.CompleteResponse.FromString(messages[0]).token_ids) == 5


@pytest.mark.engine
def test_bad_input_over_grpc_web_is_invalid_argument(tiny_server):
    _, status = call(tiny_server.web_url, "Generate", frame(generate(8, temperature=5.0)))
    assert status["grpc-status"] == "3" and "temperature" in status["grpc-message"]
    _, status = call(tiny_server.web_url, "Generate", struct.pack(">BI", 0, 3) + b"\xff\xff\xff")
    assert status["grpc-status"] == "3" and "could not be parsed" in status["grpc-message"]
    _, status = call(tiny_server.web_url, "Cancel", frame(pb.CancelRequest(request_id="nobody-has-this-id")))
    assert status["grpc-status"] == "5"  # NOT_FOUND


@pytest.mark.engine
def test_the_grpc_timeout_header_is_the_calls_deadline(tiny_server):
    # 1500 tokens take far longer than 1.5 s: the call ends at its deadline, most likely mid-stream
    # (the status then comes in the trailers, after the chunks).
    messages, status = call(tiny_server.web_url, "Generate", frame(generate(1500)), headers={"grpc-timeout": "1500m"})
    chunks = [pb.GenerateChunk.FromString(m) for m in messages]
    index = 0
    for chunk in chunks:  # none lost or repeated before the deadline
        assert chunk.index == index
        index += len(chunk.token_ids)
    if status["grpc-status"] == "0":  # the engine's own deadline check came first: the final chunk says so
        assert chunks[-1].finish_reason == pb.DEADLINE
    else:
        assert status["grpc-status"] == "4", status  # DEADLINE_EXCEEDED
    assert sum(len(c.token_ids) for c in chunks) < 1500


# ------------------------------------------------------------------ auth and CORS, simulated engine

@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("web-auth") / "keys.json"
    write_keys(path, {"web": KEY})
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--api-keys", str(path), "--idempotency-db", "off",
                      "--web-port", "0", "--web-cors-origin", "http://app.example").start()
    yield s
    s.stop()


def test_grpc_web_takes_the_same_bearer_keys(keyed_server):
    base = keyed_server.web_url
    for headers in ({}, {"authorization": "Bearer not-a-key"}):
        for method, body in (("ListModels", frame(pb.ListModelsRequest())), ("Generate", frame(generate(4)))):
            _, status = call(base, method, body, headers)
            assert status["grpc-status"] == "16", (method, headers, status)  # UNAUTHENTICATED
    messages, status = call(base, "ListModels", frame(pb.ListModelsRequest()), {"authorization": f"Bearer {KEY}"})
    assert status["grpc-status"] == "0"
    assert [m.name for m in pb.ListModelsResponse.FromString(messages[0]).models] == ["tiny-llama"]
    messages, status = call(base, "Generate", frame(generate(4)), {"authorization": f"Bearer {KEY}"})
    assert status["grpc-status"] == "0" and pb.GenerateChunk.FromString(messages[-1]).usage.completion_tokens == 4


def test_cross_origin_calls_are_allowed_only_from_the_configured_origin(keyed_server):
    url = keyed_server.web_url + SERVICE + "Generate"
    ask = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    allowed = httpx.options(url, headers={"origin": "http://app.example", **ask})
    assert allowed.status_code == 204 and allowed.headers["access-control-allow-origin"] == "http://app.example"
    assert "authorization" in allowed.headers["access-control-allow-headers"]
    assert "grpc-status" in allowed.headers["access-control-expose-headers"]
    refused = httpx.options(url, headers={"origin": "http://elsewhere.example", **ask})
    assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers


# ------------------------------------------------------------------ the page and the Node client

def _needs(*paths: pathlib.Path) -> None:
    """A missing part fails the test (saying how to get it): `make test` installs them all. Skipped only
    when asked to, with TOKENLINE_SKIP_BROWSER=1."""
    missing = [str(p) for p in paths if not p.exists()] + (["node"] if NODE is None else [])
    if missing and os.environ.get("TOKENLINE_SKIP_BROWSER"):
        pytest.skip(f"TOKENLINE_SKIP_BROWSER is set (missing: {', '.join(missing)})")
    assert not missing, (f"missing {', '.join(missing)}: `make test` builds the page and the Node client "
                         "(`make web`) and installs Chromium (`make chromium`, as root)")


@pytest.mark.engine
def test_the_page_streams_shows_the_figures_and_cancels_in_chromium(tiny_server, tmp_path):
    _needs(ROOT / "build" / "web" / "app.js", ROOT / "node_modules" / "playwright-core", CHROMIUM)
    shot = ROOT / "build" / "test-web-page.png"
    out = subprocess.run([NODE, str(ROOT / "tests" / "web" / "drive_page.mjs"), tiny_server.web_url + "/", str(shot)],
                         capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["models"] == ["tiny-llama"]
    done = seen["complete"]
    assert done["state"] == "done" and done["finish"] == "length", done
    assert done["tokens"].startswith("24"), done  # every token arrived (ignore EOS, 24 asked for)
    for figure in ("ttft", "itl", "total"):
        assert done[figure].endswith("ms"), (figure, done)
    assert all(v.endswith("ms") for v in done["split"].values()), done["split"]
    assert done["splitBars"] == 5 and done["chartInk"]
    # Logprobs asked on the page: every chunk's tooltip has one line per token, a log-probability on each.
    lines = [line for title in done["tokenTitles"] for line in title.splitlines()]
    assert len(lines) == 24 and all(re.search(r" -?\d+\.\d{3} · ", line) for line in lines), done["tokenTitles"]
    assert shot.stat().st_size > 10_000
    # Cancel mid-stream: the stream stops early and the server's final chunk says cancelled.
    cancelled = seen["cancelled"]
    assert cancelled["state"] == "cancelled" and cancelled["finish"] == "cancelled", cancelled
    assert int(cancelled["tokens"].split()[0]) < 1500
    assert not seen["console"], seen["console"]


@pytest.mark.engine
def test_the_node_client_streams_with_its_generated_stub(tiny_server):
    script = ROOT / "build" / "node" / "stream.cjs"
    _needs(script)
    out = subprocess.run([NODE, str(script), "--target", tiny_server.address, "--max-tokens", "10", "--temperature", "0",
                          "--text", "--ignore-eos", "--json", "The sea is"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert figures["tokens"] == 10 and figures["finish"] == "length"
    assert figures["ttftMs"] > 0 and figures["itlP50Ms"] >= 0 and figures["itlMaxMs"] >= figures["itlP50Ms"]
    assert figures["totalMs"] >= figures["ttftMs"] and figures["server"]["decodeMs"] >= 0
    assert any(line.startswith("ttft ") and "itl p50" in line for line in lines)
    # A refusal comes back as the gRPC status, and a failing exit status.
    bad = subprocess.run([NODE, str(script), "--target", tiny_server.address, "--temperature", "9", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    # A format and logprobs, as a Node service would ask for them.
    shaped = subprocess.run([NODE, str(script), "--target", tiny_server.address, "--max-tokens", "200", "--temperature", "0",
                             "--text", "--regex", "(ab){5}!", "--logprobs", "2", "--json", "x"],
                            capture_output=True, text=True, timeout=120)
    assert shaped.returncode == 0, shaped.stderr
    figures = json.loads(shaped.stdout.strip().splitlines()[-1])
    # The text of each token, the end-of-sequence token that closes the format included (as its own text).
    assert "".join(p["text"] for p in figures["logprobs"]) == "ababababab!<|im_end|>"
    assert figures["tokens"] == len(figures["logprobs"]) and all(len(p["top"]) == 2 for p in figures["logprobs"])


def test_bench_web_measures_both_paths_side_by_side(keyed_server):
    out = subprocess.run([sys.executable, "-m", "tokenline.server.cli", "bench", "web", "--target", keyed_server.address,
                          "--web-url", keyed_server.web_url, "--api-key", KEY, "--requests", "2", "--warmup", "0",
                          "--max-tokens", "4", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for path in ("grpc", "grpc-web"):
        assert result[path]["requests"] == 2 and result[path]["ttft_p50_ms"] > 0
    assert result["ratio_ttft_p50"] > 0 and result["ratio_itl_p50"] > 0
