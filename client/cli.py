"""`tokenline generate`: send one prompt, print the answer as it streams, then where the time went.

The `tokenline` console script (server/cli.py) mounts this with
`add_generate_parser(subparsers)`; the parser's `func` default is `run_generate`.
Exit status: 0 done, 2 bad usage or a request the server calls invalid,
1 any other failure, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ._channel import DEFAULT_TARGET
from ._client import Client, DeltaStream
from ._timing import StreamTiming, stream_timing
from ._types import Delta
from .errors import InvalidRequest, TokenlineError, Unauthenticated, Unavailable

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

EPILOG = f"""\
examples:
  tokenline generate "What is the capital of France?"
  tokenline generate --raw --max-tokens 32 --temperature 0.8 "Once upon a time"
  echo "Summarize: ..." | tokenline generate --json -
  tokenline generate --json-schema person.json --logprobs 5 "Describe a person as JSON"
  tokenline generate --choice yes --choice no --presence-penalty 0.5 "Is the sky blue?"

The answer streams to stdout; a summary goes to stderr, e.g.
  ttft 212 ms · itl 57.1 ms (mean) · total 1.94 s · 32 tokens (prompt 14) · stop · server ttft 180 ms (queued 3.2 ms)
ttft and itl are measured by this client from the send time and chunk arrivals;
"server" figures come from the server's timeline. The API key is read from
--api-key or $TOKENLINE_API_KEY. Server: --target (default {DEFAULT_TARGET}).
"""


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `generate` subcommand to an argparse subparsers object and return its parser."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text from one prompt, streaming the answer",
        description="Send one prompt to a tokenline server and print the answer token by token.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompt", help='the prompt text; "-" reads it from stdin')
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help="server address host:port (default %(default)s)"
    )
    parser.add_argument(
        "--model", default="", help="model name as `ListModels` gives it (default: the server's)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="most tokens to generate (default: the server's, the rest of the context up to its cap)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy and reproducible (default %(default)s)",
    )
    parser.add_argument("--top-p", type=float, help="nucleus sampling threshold in (0, 1]")
    parser.add_argument("--top-k", type=int, help="sample among the K most likely tokens")
    parser.add_argument("--seed", type=int, help="random seed for reproducible sampling")
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when TEXT is generated (repeatable)",
    )
    parser.add_argument("--min-p", type=float, help="drop tokens below this share of the most likely one's probability")
    parser.add_argument("--repetition-penalty", type=float, help="above 1 discourages tokens already seen, in (0, 2]")
    parser.add_argument("--presence-penalty", type=float, help="subtracted once from tokens already output, in [-2, 2]")
    parser.add_argument("--frequency-penalty", type=float, help="subtracted per time a token was output, in [-2, 2]")
    parser.add_argument("--min-tokens", type=int, default=0, metavar="N", help="no end of sequence before N tokens")
    parser.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=[], metavar="ID",
                        help="stop when token ID is generated (repeatable)")
    parser.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                        help="add BIAS in [-100, 100] to token ID's logit (repeatable)")
    parser.add_argument("-n", "--samples", dest="n", type=int, default=1, metavar="N",
                        help="N independent samples of the prompt, printed one after another (default 1)")
    parser.add_argument("--logprobs", type=int, metavar="K",
                        help="print each token's log-probability and its K most likely alternatives (0..20)")
    formats = parser.add_mutually_exclusive_group()
    formats.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against the schema in FILE")
    formats.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    formats.add_argument("--regex", help="the output matches this regular expression")
    formats.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    formats.add_argument("--grammar", metavar="FILE", help="the output follows the EBNF grammar in FILE")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past end-of-sequence until --max-tokens",
    )
    parser.add_argument(
        "--class",
        dest="traffic_class",
        choices=("interactive", "bulk"),
        default="interactive",
        help="traffic class (default %(default)s)",
    )
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send the prompt as one user chat message, so an instruct model answers it"
        " (default); --no-chat sends it as plain text",
    )
    parser.add_argument("--raw", dest="chat", action="store_false", help="same as --no-chat")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TOKENLINE_API_KEY"),
        help="API key (default: $TOKENLINE_API_KEY)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="give up after SECONDS; also sent to the server as the request's deadline",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the final result, client timing and server timeline as JSON instead of streaming text",
    )
    parser.set_defaults(func=run_generate)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    """Run `tokenline generate` with parsed arguments; returns the exit status."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    deltas: list[Delta] = []
    stream: DeltaStream | None = None
    try:
        features = request_features(args)
        with Client(args.target, api_key=args.api_key) as client:
            stream = client.generate(
                None if args.chat else prompt,
                messages=[("user", prompt)] if args.chat else None,
                model=args.model,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                stop=args.stop,
                ignore_eos=args.ignore_eos,
                traffic_class=args.traffic_class,
                deadline_s=args.timeout,
                **features,
            )
            for delta in stream:
                deltas.append(delta)
                if args.json or args.n > 1:  # samples interleave: printed whole, one after another, at the end
                    continue
                if args.logprobs is not None:
                    for position in delta.logprobs:
                        print(logprob_line(position), file=sys.stderr)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        if stream is not None:
            stream.cancel()
        _end_text_line(deltas, args)
        print("tokenline generate: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as error:  # a schema or grammar file that cannot be read
        print(f"tokenline generate: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, InvalidRequest) as error:
        _end_text_line(deltas, args)
        print(f"tokenline generate: {error}", file=sys.stderr)
        return EXIT_USAGE
    except TokenlineError as error:
        _end_text_line(deltas, args)
        print(f"tokenline generate: {error}{_hint(error, args.target)}", file=sys.stderr)
        return EXIT_FAILED

    if args.n > 1 and not args.json:
        for i in range(args.n):
            print(f"--- sample {i}")
            print("".join(d.text for d in deltas if d.sample_index == i))
    timing = stream_timing(stream.sent_at, deltas)
    if args.json:
        print(json.dumps(result_json(deltas, timing), indent=2, ensure_ascii=False))
    else:
        _end_text_line(deltas, args)
        print(summary_line(deltas, timing), file=sys.stderr)
    return EXIT_OK


def request_features(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling, logprob and format options as generate() keyword arguments (files read here)."""
    bias = {}
    for item in args.logit_bias:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias takes ID=BIAS (e.g. 50256=-100), not {item!r}") from None
    features: dict[str, Any] = dict(
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens, stop_token_ids=args.stop_token_ids,
        logit_bias=bias, logprobs=args.logprobs, n=args.n)
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            features["json_schema"] = f.read()
    elif args.grammar:
        with open(args.grammar, encoding="utf-8") as f:
            features["grammar"] = f.read()
    elif args.json_object:
        features["json_object"] = True
    elif args.regex:
        features["regex"] = args.regex
    elif args.choice:
        features["choice"] = args.choice
    return features


def logprob_line(position: Any) -> str:
    """One token's log-probability and its alternatives, for stderr: '  'Paris' -0.021 | ' Lyon' -4.2 ...'."""
    alternatives = " | ".join(f"{t.text!r} {t.logprob:.3f}" for t in position.top)
    return f"  {position.token.text!r} {position.token.logprob:.3f}" + (f"   [{alternatives}]" if alternatives else "")


def format_duration(seconds: float) -> str:
    """'212 ms', '57.1 ms', '0.42 ms' below a second; '1.94 s' above."""
    millis = seconds * 1000
    if millis >= 1000:
        return f"{seconds:.2f} s"
    if millis >= 100:
        return f"{millis:.0f} ms"
    if millis >= 1:
        return f"{millis:.1f} ms"
    return f"{millis:.2f} ms"


def summary_line(deltas: Sequence[Delta], timing: StreamTiming) -> str:
    """The one-line account printed after the answer, client timing first, then the server's."""
    final = deltas[-1] if deltas else None
    parts = []
    if timing.ttft_s is not None:
        parts.append(f"ttft {format_duration(timing.ttft_s)}")
    if timing.itl_mean_s is not None:
        parts.append(f"itl {format_duration(timing.itl_mean_s)} (mean)")
    if timing.total_s is not None:
        parts.append(f"total {format_duration(timing.total_s)}")
    usage = final.usage if final else None
    tokens = usage.completion_tokens if usage else timing.tokens
    parts.append(f"{tokens} tokens" + (f" (prompt {usage.prompt_tokens})" if usage else ""))
    parts.append((final.finish_reason if final else None) or "unfinished")
    timeline = final.timeline if final else None
    if timeline is not None:
        queued_s = (timeline.admission_wait_ms + timeline.queueing_ms) / 1000
        parts.append(
            f"server ttft {format_duration(timeline.ttft_ms / 1000)} (queued {format_duration(queued_s)})"
        )
        if timeline.attempts > 1:
            parts.append(f"{timeline.attempts} attempts")
    return " · ".join(parts)


def result_json(deltas: Sequence[Delta], timing: StreamTiming) -> dict[str, Any]:
    """The --json document: the whole result, the client's timing and the server's timeline."""
    final = deltas[-1] if deltas else None

    def millis(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000, 3)

    return {
        "request_id": final.request_id if final else "",
        "attempt": final.attempt if final else 0,
        "text": "".join(d.text for d in deltas if d.sample_index == 0),  # with n > 1, sample 0's: all in "samples"
        "token_ids": [t for d in deltas if d.sample_index == 0 for t in d.token_ids],
        "finish_reason": final.finish_reason if final else None,
        "usage": dataclasses.asdict(final.usage) if final and final.usage else None,
        "logprobs": [dataclasses.asdict(p) for d in deltas for p in d.logprobs] or None,
        "samples": [{"sample_index": i, "text": "".join(d.text for d in deltas if d.sample_index == i),
                     "token_ids": [t for d in deltas if d.sample_index == i for t in d.token_ids],
                     "finish_reason": next((d.finish_reason for d in deltas if d.sample_index == i and d.finish_reason),
                                           None)}
                    for i in sorted({d.sample_index for d in deltas})] if any(d.sample_index for d in deltas) else None,
        "client": {
            "ttft_ms": millis(timing.ttft_s),
            "itl_mean_ms": millis(timing.itl_mean_s),
            "total_ms": millis(timing.total_s),
            "tokens": timing.tokens,
            "chunks": timing.chunks,
        },
        "timeline": dataclasses.asdict(final.timeline) if final and final.timeline else None,
    }


def _end_text_line(deltas: Sequence[Delta], args: argparse.Namespace) -> None:
    # Keep the shell prompt (and the summary) off the answer's last line.
    if not args.json and deltas and not "".join(d.text for d in deltas).endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()


def _hint(error: TokenlineError, target: str) -> str:
    if isinstance(error, Unavailable):
        return f"; is a tokenline server running at {target}?"
    if isinstance(error, Unauthenticated):
        return "; pass --api-key or set TOKENLINE_API_KEY"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the generate subcommand alone: `python -m tokenline.client.cli generate ...`."""
    parser = argparse.ArgumentParser(prog="tokenline")
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
