"""`tokenline admin rollout NAME MODEL`: operate a running server (needs an admin tenant, or loopback).

Exit status: 0 done, 1 the server refused or failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ._channel import DEFAULT_TARGET
from ._client import Client
from .errors import TokenlineError

EPILOG = f"""\
examples:
  tokenline admin rollout chat /models/smol-v2          # chat moves to the new weights; no stream is dropped
  tokenline admin rollout chat /models/smol-v2 --workers 3

The new version's workers start beside the current ones; once all are ready, requests naming the model go to
it, running streams finish on the version they started on, and the old version stops as they end.
The API key is read from --api-key or $TOKENLINE_API_KEY (an admin tenant). Server: --target (default {DEFAULT_TARGET}).
"""


def add_admin_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("admin", help="operate a running server: roll a model out to a new version",
                                   epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="admin_command", required=True)
    roll = sub.add_parser("rollout", help="move a model to a new version without dropping a stream")
    roll.add_argument("name", help="the model, as callers name it")
    roll.add_argument("model", help="the new version: a model folder, or a built-in name ('tiny', 'tiny-trained')")
    roll.add_argument("--workers", type=int, default=0, help="its workers (default: as many as the current version)")
    roll.add_argument("--target", default=DEFAULT_TARGET, help="server address host:port (default %(default)s)")
    roll.add_argument("--api-key", default=os.environ.get("TOKENLINE_API_KEY"), help="API key (default: $TOKENLINE_API_KEY)")
    roll.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run_admin)
    return parser


def run_admin(args: argparse.Namespace) -> int:
    if args.workers < 0:
        print("tokenline admin: --workers must be 0 (as now) or more", file=sys.stderr)
        return 2
    try:
        with Client(args.target, api_key=args.api_key) as client:
            done = client.roll_out(args.name, args.model, workers=args.workers)
    except TokenlineError as err:
        print(f"tokenline admin: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(done))
    else:
        print(f"{done['name']}: version {done['version']} is current ({done['workers']} workers); version "
              f"{done['previous_version']} finishes its streams and stops")
    return 0
