"""A stand-in tokenline server with no engine: it streams made-up tokens as fast as gRPC allows.

    python -m tokenline.bench.loopback [--port 0] [--tokens-per-chunk 1]

`bench loadgen` drives it to measure the load generator's own ceiling: every
cost left is the client's (and this stub's) gRPC and Python work.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import grpc
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc


class LoopbackServicer(pb_grpc.TokenlineServicer):
    def __init__(self, tokens_per_chunk: int):
        self.tokens_per_chunk = tokens_per_chunk

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        start = time.monotonic()
        n = max(1, request.sampling.max_tokens or 64)
        prompt = len(request.token_ids.ids) if request.HasField("token_ids") else len(request.text.split())
        step = self.tokens_per_chunk
        for index in range(0, n, step):
            yield pb.GenerateChunk(request_id=request.request_id, attempt=1, index=index,
                                   token_ids=range(index % 97, index % 97 + min(step, n - index)))
        ms = (time.monotonic() - start) * 1000
        yield pb.GenerateChunk(
            request_id=request.request_id, attempt=1, index=n, finish_reason=pb.LENGTH,
            usage=pb.Usage(prompt_tokens=prompt, completion_tokens=n),
            timeline=pb.Timeline(received_ms=0, validated_ms=0, enqueued_ms=0, admitted_ms=0, first_token_ms=0,
                                 finished_ms=ms, last_byte_ms=ms, decode_ms=ms, completion_ms=ms, attempts=1),
        )

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return pb.ListModelsResponse(models=[pb.ModelInfo(name="loopback", version="0", max_context=1 << 20,
                                                          loaded=True, workers=1)])


async def serve(host: str, port: int, tokens_per_chunk: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_TokenlineServicer_to_server(LoopbackServicer(tokens_per_chunk), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"loopback: serving on {host}:{bound}", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenline.bench.loopback", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.run(serve(args.host, args.port, args.tokens_per_chunk))
    except ImportError:
        asyncio.run(serve(args.host, args.port, args.tokens_per_chunk))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
