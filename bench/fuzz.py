"""Fuzzing the request messages of a running server: every answer must be a legitimate status.

Structured inputs come from a hypothesis strategy over GenerateRequest (any field, any value,
hostile text, huge numbers, NaN); raw inputs are random bytes sent to every method. Legitimate
answers are OK or a refusal that says why (ALLOWED); UNKNOWN or INTERNAL are failures, and so is a
server that stops answering. tests/test_fuzz.py runs a short version; this runs as many as asked:

    python -m tokenline.bench.fuzz --structured 8000 --raw 4000     # starts a sim-engine server on loopback
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter

import grpc

from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

# Legitimate answers to arbitrary input: served, invalid, too big, unknown model, deadline already
# past, id in use, idempotency key reused for other work, nothing left to resume. Never UNKNOWN or INTERNAL.
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED}
RAW_METHODS = ["/tokenline.v1.Tokenline/Complete", "/tokenline.v1.Tokenline/Cancel", "/tokenline.v1.Tokenline/ListModels"]


def requests():
    """A hypothesis strategy: GenerateRequests with every field drawn from hostile ranges."""
    from hypothesis import strategies as st

    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, 2.0, -0.0]))

    @st.composite
    def build(draw):
        req = pb.GenerateRequest()
        req.model = draw(st.one_of(st.just(""), st.just("tiny-llama"), st.text(max_size=20)))
        kind = draw(st.sampled_from(["none", "text", "ids", "chat"]))
        if kind == "text":
            req.text = draw(st.text(max_size=300))
        elif kind == "ids":
            req.token_ids.ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=50)))
            if not req.token_ids.ids:
                req.token_ids.SetInParent()
        elif kind == "chat":
            req.chat.SetInParent()
            for _ in range(draw(st.integers(0, 4))):
                req.chat.messages.add(role=draw(st.sampled_from(["user", "system", "assistant", "", "robot"])),
                                      content=draw(st.text(max_size=50)))
        if draw(st.booleans()):
            s = req.sampling
            s.max_tokens = draw(st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)))
            if draw(st.booleans()):
                s.temperature = draw(floats)
            if draw(st.booleans()):
                s.top_p = draw(floats)
            if draw(st.booleans()):
                s.top_k = draw(st.integers(-2**31, 2**31 - 1))
            if draw(st.booleans()):
                s.seed = draw(st.integers(0, 2**64 - 1))
            s.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
            s.ignore_eos = draw(st.booleans())
        req.traffic_class = draw(st.integers(0, 5))
        req.request_id = draw(st.one_of(st.just(""), st.text(max_size=140)))
        req.deadline_unix_ms = draw(st.one_of(st.just(0), st.integers(0, 2**64 - 1)))
        if draw(st.booleans()):
            req.idempotency_key = draw(st.text(max_size=80))
            req.resume_from_index = draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1)))
        return req

    return build()


def cap(req: pb.GenerateRequest) -> pb.GenerateRequest:
    """Keep accepted work short: the fuzz target is the frontend, not generation."""
    if req.sampling.max_tokens < 4096 and not 0 < req.sampling.max_tokens <= 8:  # 0: the rest of the context
        req.sampling.max_tokens = 8
    return req


def send(channel: grpc.Channel, req: pb.GenerateRequest, streaming: bool) -> tuple[grpc.StatusCode, str]:
    stub = pb_grpc.TokenlineStub(channel)
    try:
        if streaming:
            for _ in stub.Generate(req, timeout=30):
                pass
        else:
            stub.Complete(req, timeout=30)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details() or ""


def send_raw(channel: grpc.Channel, payload: bytes, method: str) -> grpc.StatusCode:
    try:
        channel.unary_unary(method)(payload, timeout=30)  # bytes in, bytes out
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


def fuzz_structured(channel: grpc.Channel, examples: int, seed: int, codes: Counter, failures: list[str]) -> int:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    tried = 0

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests(), st.booleans())
    def one(req, streaming):
        nonlocal tried
        tried += 1
        _progress(tried, examples, "structured")
        code, details = send(channel, cap(req), streaming)
        codes[code.name] += 1
        if code not in ALLOWED or (code != grpc.StatusCode.OK and not details):
            if len(failures) < 20:
                failures.append(f"{code.name} ({details!r}) for {req}")

    one()
    return tried


def fuzz_raw(channel: grpc.Channel, count: int, seed: int, codes: Counter, failures: list[str]) -> int:
    rng = random.Random(seed)
    for i in range(count):
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200)))
        code = send_raw(channel, payload, RAW_METHODS[i % len(RAW_METHODS)])
        _progress(i + 1, count, "raw")
        codes[code.name] += 1
        if code not in ALLOWED and len(failures) < 20:
            failures.append(f"{code.name} for raw bytes {payload[:40]!r}")
    return count


def _progress(done: int, total: int, what: str) -> None:
    if done % 1000 == 0 or done == total:
        print(f"fuzz: {what} {done}/{total}", file=sys.stderr, flush=True)


def alive(channel: grpc.Channel) -> bool:
    req = pb.GenerateRequest(text="alive", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
    try:
        return len(pb_grpc.TokenlineStub(channel).Complete(req, timeout=30).token_ids) == 3
    except grpc.RpcError:
        return False


def run(address: str, structured: int, raw: int, seed: int) -> dict:
    structured_codes, raw_codes, failures = Counter(), Counter(), []
    started = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        n_structured = fuzz_structured(channel, structured, seed, structured_codes, failures) if structured else 0
        n_raw = fuzz_raw(channel, raw, seed, raw_codes, failures) if raw else 0
        still_alive = alive(channel)
    bad = sum(n for code, n in (structured_codes + raw_codes).items() if code in ("UNKNOWN", "INTERNAL"))
    return {"ok": not failures and still_alive, "inputs": n_structured + n_raw, "structured": n_structured, "raw": n_raw,
            "structured_answers": dict(structured_codes), "raw_answers": dict(raw_codes), "unknown_or_internal": bad,
            "server_alive": still_alive, "seconds": round(time.monotonic() - started, 1), "failures": failures}


EXAMPLES = """examples:
  python -m tokenline.bench.fuzz --structured 8000 --raw 4000    # a sim-engine server is started here
  tokenline bench fuzz --target 127.0.0.1:50051 --structured 2000 --raw 0
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="host:port of a running server (default: start a sim-engine server here)")
    p.add_argument("--structured", type=int, default=8000, help="hypothesis-generated requests (default %(default)s)")
    p.add_argument("--raw", type=int, default=4000, help="random byte strings (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenline.bench.fuzz", description=__doc__.split("\n\n")[0],
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_command(p.parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Fuzz and print the report as JSON; 0 when every answer was legitimate and the server is alive."""
    server = None
    address = args.target
    if address is None:
        from tokenline.bench.chaos import Server

        server = Server(["--engine", "sim", "--model", "tiny", "--workers", "1", "--max-seqs", "8",
                         "--log-level", "WARNING", "--request-log-level", "WARNING"])
        server.wait_ready(300)
        address = server.address
    try:
        report = run(address, args.structured, args.raw, args.seed)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
