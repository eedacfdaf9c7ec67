"""Builds the gRPC code from protos/ before setuptools collects packages.

The generated modules land in build/gen/tokenline/v1 (mapped to the
`tokenline.v1` package in pyproject.toml), both for wheels and for editable
installs, so generated code is never committed.
"""

import pathlib

from setuptools import setup

ROOT = pathlib.Path(__file__).parent
PROTOS = ROOT / "protos"
OUT = ROOT / "build" / "gen"


def generate_protos() -> None:
    from grpc_tools import protoc  # build requirement
    import grpc_tools

    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    OUT.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed on " + " ".join(sources))
    (OUT / "tokenline" / "v1" / "__init__.py").write_text('"""Generated from protos/tokenline/v1."""\n')
    (OUT / "tokenline" / "v1" / "py.typed").write_text("")


generate_protos()
setup()
