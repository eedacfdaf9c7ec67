"""`python -m tokenline.engine.prepare prepare [--tiny]`: build the model folders tokenline serves, once, into
the local cache, each with its self-check reference (what `make run` and `make test` run first).

Apart from engine/models.py (the builders) so that models.py and selfcheck.py do not import each other.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenline.engine import selfcheck
from tokenline.engine.models import (ModelPrepError, build_tiny_model, build_tiny_trained_model, cache_dir,
                                     prepare_default_model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenline.engine.prepare",
        description="Build the model folders tokenline serves, once, into a local cache.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  python -m tokenline.engine.prepare prepare            # SmolLM2-135M-Instruct\n"
            "  python -m tokenline.engine.prepare prepare --tiny     # tiny models for tests (random, and trained)\n"
            "  python -m tokenline.engine.prepare prepare --cache /tmp/tl\n"
            "The folder's path is printed on the last line of stdout."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="build a model folder (no-op if already built)")
    prepare.add_argument("--tiny", action="store_true", help="build the tiny test models instead (random, and trained)")
    prepare.add_argument(
        "--cache", type=Path, help="cache folder (default: $TOKENLINE_CACHE or ~/.cache/tokenline)"
    )
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        if args.tiny:
            trained = build_tiny_trained_model((args.cache or cache_dir()) / "models" / "tiny-llama-trained")
            selfcheck.reference_for(trained, args.cache or cache_dir(), log=log)
            path = build_tiny_model((args.cache or cache_dir()) / "models" / "tiny-llama")
        else:
            path = prepare_default_model(args.cache, log=log)
        selfcheck.reference_for(path, args.cache or cache_dir(), log=log)
    except ModelPrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
