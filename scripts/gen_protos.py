#!/usr/bin/env python
"""Generate the Python gRPC stubs for every proto/specdec/v1/*.proto into specdec_rpc/pb/.

    python scripts/gen_protos.py           # (re)generate specdec_rpc/pb/*_pb2*.py(i)
    python scripts/gen_protos.py --check   # exit 1 if the stubs are missing or stale

Building the package runs the same generation (setup.py's build hook: `pip install .` puts the stubs in the wheel,
`pip install -e .` into specdec_rpc/pb/ of the checkout); `make proto` runs this script after a .proto changed.

Uses the protoc bundled with grpcio-tools, which must not be newer than the runtime grpcio (generated
`_pb2_grpc.py` files refuse to import on an older grpcio): the same version here, the pinned one in the build hook.
protoc emits absolute imports (`from specdec.v1 import common_pb2`); they are rewritten to package-relative ones
(`from . import common_pb2`) so the stubs live flat in `specdec_rpc.pb`. The generated files are git-ignored.
"""
from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "specdec" / "v1"
OUT_DIR = ROOT / "specdec_rpc" / "pb"
_ABS_IMPORT = re.compile(r"^from specdec\.v1 import (\w+_pb2)", re.MULTILINE)
_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def check_versions() -> None:
    tools, runtime = metadata.version("grpcio-tools"), metadata.version("grpcio")
    if tools != runtime:
        sys.exit(f"grpcio-tools {tools} != grpcio {runtime}: install grpcio-tools=={runtime} "
                 "so the generated stubs import on this runtime")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every proto in PROTO_DIR, write flat stubs with fixed imports into out_dir."""
    from grpc_tools import protoc  # imported here so --help works without grpcio-tools
    import grpc_tools

    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        sys.exit(f"no .proto files under {PROTO_DIR}")
    include = str(Path(grpc_tools.__file__).parent / "_proto")  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *[str(p.relative_to(PROTO_ROOT)) for p in protos]]
        if protoc.main(args) != 0:
            sys.exit("protoc failed (see the message above)")
        written = []
        out_dir.mkdir(parents=True, exist_ok=True)
        for src in sorted((Path(tmp) / "specdec" / "v1").iterdir()):
            if not src.name.endswith(_SUFFIXES):
                continue
            dst = out_dir / src.name
            dst.write_text(_ABS_IMPORT.sub(r"from . import \1", src.read_text()))
            written.append(dst)
    return written


def check() -> int:
    """Return 0 when specdec_rpc/pb holds exactly what generate() would write now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f.name for f in fresh
                 if not (OUT_DIR / f.name).exists() or not filecmp.cmp(f, OUT_DIR / f.name, shallow=False)]
        extra = [p.name for p in OUT_DIR.iterdir()
                 if p.name.endswith(_SUFFIXES) and p.name not in {f.name for f in fresh}]
    if stale or extra:
        print(f"stubs out of date: missing/stale {stale}, orphaned {extra}; run `make proto`", file=sys.stderr)
        return 1
    print(f"{len(fresh)} stub files up to date")
    return 0


def regenerate(out_dir: Path) -> list[Path]:
    """Generate the stubs into out_dir, first removing stubs there of protos that no longer exist."""
    for p in out_dir.iterdir() if out_dir.exists() else []:
        if p.name.endswith(_SUFFIXES):
            p.unlink()
    return generate(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs are missing or stale")
    args = parser.parse_args(argv)
    check_versions()
    if args.check:
        return check()
    written = regenerate(OUT_DIR)
    print(f"wrote {len(written)} files to {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
