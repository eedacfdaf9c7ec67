"""`tokenline admin rollout NAME MODEL`, `load-adapter`, `unload-adapter`: operate a running server (needs an admin
tenant, or loopback).

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
  tokenline admin load-adapter chat support /adapters/support   # requests may name model "support" from now on
  tokenline admin unload-adapter support --wait                 # its streams finish on it; then its slot is free

The new version's workers start beside the current ones; once all are ready, requests naming the model go to
it, running streams finish on the version they started on, and the old version stops as they end.
A LoRA adapter loads into a model started with room for it (tokenline serve --max-loras N).
The API key is read from --api-key or $TOKENLINE_API_KEY (an admin tenant). Server: --target (default {DEFAULT_TARGET}).
"""


def add_admin_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("admin", help="operate a running server: roll a model out to a new version, load or "
                                   "unload LoRA adapters",
                                   epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="admin_command", required=True)
    roll = sub.add_parser("rollout", help="move a model to a new version without dropping a stream")
    roll.add_argument("name", help="the model, as callers name it")
    roll.add_argument("model", help="the new version: a model folder, or a built-in name ('tiny', 'tiny-trained')")
    roll.add_argument("--workers", type=int, default=0, help="its workers (default: as many as the current version)")
    load = sub.add_parser("load-adapter", help="serve a LoRA adapter of a model, without a restart")
    load.add_argument("model", help="the model it adapts, as callers name it")
    load.add_argument("name", help="the name requests will give as their model")
    load.add_argument("folder", help="the adapter's folder (adapter_config.json, adapter_model.safetensors) on the "
                                     "server's machine")
    unload = sub.add_parser("unload-adapter", help="stop serving a LoRA adapter; its running streams finish on it")
    unload.add_argument("name", help="the adapter's name")
    unload.add_argument("--wait", action="store_true", help="return once its streams ended and its slot is free")
    for p in (roll, load, unload):
        p.add_argument("--target", default=DEFAULT_TARGET, help="server address host:port (default %(default)s)")
        p.add_argument("--api-key", default=os.environ.get("TOKENLINE_API_KEY"), help="API key (default: $TOKENLINE_API_KEY)")
        p.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run_admin)
    return parser


def run_admin(args: argparse.Namespace) -> int:
    if args.admin_command in ("load-adapter", "unload-adapter"):
        return _adapter_command(args)
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


def _adapter_command(args: argparse.Namespace) -> int:
    try:
        with Client(args.target, api_key=args.api_key) as client:
            if args.admin_command == "load-adapter":
                done = client.load_adapter(args.model, args.name, args.folder)
            else:
                done = client.unload_adapter(args.name, wait=args.wait)
    except TokenlineError as err:
        print(f"tokenline admin: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(done))
    elif args.admin_command == "load-adapter":
        print(f"{done['name']}: LoRA adapter of {done['model']}, version {done['version']}, served ({done['adapters_held']} "
              f"of {done['max_adapters']} adapters)")
    else:
        how = "its streams are finishing; its slot is freed when they end" if done["draining"] else "its slot is free"
        print(f"{done['name']}: unloaded ({how})")
    return 0
