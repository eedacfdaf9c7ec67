"""`tokenline job submit|watch|get|cancel|list`: durable jobs from the command line.

Exit status: 0 done (for watch: the job succeeded), 1 any other failure or a job
that ended otherwise, 2 bad usage or a request the server calls invalid, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from ._channel import DEFAULT_TARGET
from ._client import Client
from ._jobs import JOB_STATES, Job
from .errors import InvalidRequest, TokenlineError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

EPILOG = f"""\
examples:
  tokenline job submit --max-tokens 256 "Write a long story"   # prints the job id once it is stored
  tokenline job watch JOB_ID                 # its text as it is stored, then how it ended
  tokenline job watch JOB_ID --from 120      # resume: tokens from index 120 on
  tokenline job get JOB_ID --json            # state and result so far
  tokenline job cancel JOB_ID
  tokenline job list --state running --state queued

A job survives the server: it runs to its end even if the server is killed
(the restarted server, or another sharing its --job-store, takes it over).
The API key is read from --api-key or $TOKENLINE_API_KEY. Server: --target (default {DEFAULT_TARGET}).
"""


def add_job_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("job", help="durable jobs: submit, watch, get, cancel, list", epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default=DEFAULT_TARGET, help="server address host:port (default %(default)s)")
    common.add_argument("--api-key", default=os.environ.get("TOKENLINE_API_KEY"),
                        help="API key (default: $TOKENLINE_API_KEY)")
    common.add_argument("--json", action="store_true", help="print JSON")
    sub = parser.add_subparsers(dest="job_command", required=True)
    submit = sub.add_parser("submit", parents=[common], help="record a generation as a job; prints its id")
    submit.add_argument("prompt", help='the prompt text; "-" reads it from stdin')
    submit.add_argument("--model", default="", help="model name (default: the server's)")
    submit.add_argument("--max-tokens", type=int, default=128, metavar="N", help="most tokens (default %(default)s)")
    submit.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default %(default)s)")
    submit.add_argument("--seed", type=int, help="random seed")
    submit.add_argument("--ignore-eos", action="store_true", help="generate until --max-tokens")
    submit.add_argument("--class", dest="traffic_class", choices=("interactive", "bulk"), default="bulk",
                        help="traffic class (default %(default)s)")
    submit.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="send the prompt as one user chat message (default); --no-chat: plain text")
    submit.add_argument("--deadline-s", type=float, help="the job ends 'expired' if not done within this many seconds")
    submit.add_argument("--idempotency-key", default="", help="a retry with the same key returns the same job")
    watch = sub.add_parser("watch", parents=[common], help="stream a job's text as it is stored")
    watch.add_argument("job_id")
    watch.add_argument("--from", dest="from_index", type=int, default=0, metavar="INDEX",
                       help="first token index wanted (resume a watch)")
    for name, text in (("get", "a job's state and result so far"), ("cancel", "cancel a queued or running job")):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("job_id")
    listing = sub.add_parser("list", parents=[common], help="your jobs, oldest first")
    listing.add_argument("--state", action="append", default=[], choices=JOB_STATES, help="only this state (repeatable)")
    listing.add_argument("--page-size", type=int, default=100)
    listing.add_argument("--page-token", default="")
    parser.set_defaults(func=run_job)
    return parser


def run_job(args: argparse.Namespace) -> int:
    try:
        with Client(args.target, api_key=args.api_key) as client:
            return _COMMANDS[args.job_command](client, args)
    except KeyboardInterrupt:
        print("tokenline job: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, InvalidRequest) as error:
        print(f"tokenline job: {error}", file=sys.stderr)
        return EXIT_USAGE
    except TokenlineError as error:
        print(f"tokenline job: {error}", file=sys.stderr)
        return EXIT_FAILED


def _submit(client: Client, args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    job = client.submit_job(None if args.chat else prompt, messages=[("user", prompt)] if args.chat else None,
                            model=args.model, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            ignore_eos=args.ignore_eos, traffic_class=args.traffic_class, deadline_s=args.deadline_s,
                            idempotency_key=args.idempotency_key)
    print(json.dumps(_job_json(job)) if args.json else job.job_id)
    return EXIT_OK


def _watch(client: Client, args: argparse.Namespace) -> int:
    for chunk in client.watch_job(args.job_id, args.from_index):
        if args.json:
            print(json.dumps(dataclasses.asdict(chunk)), flush=True)
        else:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        if chunk.state is not None:
            if not args.json:
                print(f"\n[{chunk.state}{', ' + chunk.finish_reason if chunk.finish_reason else ''}"
                      f"{': ' + chunk.error if chunk.error else ''}; {chunk.index} tokens]", file=sys.stderr)
            return EXIT_OK if chunk.state == "succeeded" else EXIT_FAILED
    return EXIT_FAILED


def _get(client: Client, args: argparse.Namespace) -> int:
    _print_job(client.get_job(args.job_id), args)
    return EXIT_OK


def _cancel(client: Client, args: argparse.Namespace) -> int:
    _print_job(client.cancel_job(args.job_id), args)
    return EXIT_OK


def _list(client: Client, args: argparse.Namespace) -> int:
    jobs, token = client.list_jobs(args.state, page_size=args.page_size, page_token=args.page_token)
    if args.json:
        print(json.dumps({"jobs": [_job_json(j) for j in jobs], "next_page_token": token}))
        return EXIT_OK
    for j in jobs:
        print(f"{j.job_id}  {j.state:<9}  {j.tokens_stored:>6} tokens  attempts {j.attempts}  {j.model}")
    if token:
        print(f"more: --page-token {token}", file=sys.stderr)
    return EXIT_OK


def _print_job(job: Job, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(_job_json(job)))
    else:
        print(f"{job.job_id}  {job.state}  {job.tokens_stored} tokens  attempts {job.attempts}"
              f"{'  ' + job.finish_reason if job.finish_reason else ''}{'  error: ' + job.error if job.error else ''}")
        if job.text:
            print(job.text)


def _job_json(job: Job) -> dict[str, Any]:
    return dataclasses.asdict(job)


_COMMANDS = {"submit": _submit, "watch": _watch, "get": _get, "cancel": _cancel, "list": _list}
