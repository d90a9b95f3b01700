"""python -m target_service --model PATH --host H --port N [--device cuda:0 --dtype bfloat16 ...]"""
from __future__ import annotations

import sys

from specdec_rpc.main import run_service

from target_service.config import TargetSettings
from target_service.server import build_app


def main(argv: list[str] | None = None) -> None:
    run_service(build_app, TargetSettings.from_cli(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
