"""python -m draft_service --model PATH --host H --port N [--device cuda:0 --dtype bfloat16 ...]"""
from __future__ import annotations

import sys

from specdec_rpc.main import run_service

from draft_service.config import DraftSettings
from draft_service.server import build_app


def main(argv: list[str] | None = None) -> None:
    run_service(build_app, DraftSettings.from_cli(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
