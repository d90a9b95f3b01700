"""Launch one draft or target replica (what `specdec serve`/`generate` start as subprocesses).

    python -m coordinator.replica draft  --model PATH [--preverifier PATH] --host H --port N --threads 1
    python -m coordinator.replica target --model PATH --host H --port N --threads 1

Same settings and flags as `python -m draft_service` / `python -m target_service`, plus `--preverifier` for the
draft (loaded with `specdec.preverifier.load_preverifier`).
"""
from __future__ import annotations

import sys

from specdec.server.main import run_service


def _pop_flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            val = argv[i + 1]
            del argv[i:i + 2]
            return val
        if a.startswith(name + "="):
            del argv[i]
            return a.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("draft", "target"):
        sys.exit("usage: python -m coordinator.replica draft|target [--preverifier PATH] [service flags]")
    kind, rest = argv[0], argv[1:]
    if kind == "target":
        from target_service.config import TargetSettings
        from target_service.server import build_app

        run_service(build_app, TargetSettings.from_cli(rest))
        return
    from draft_service.config import DraftSettings
    from draft_service.server import build_app as build_draft

    pv_path = _pop_flag(rest, "--preverifier")

    async def build(settings):
        pv = None
        if pv_path:
            from specdec.preverifier import load_preverifier

            pv = load_preverifier(pv_path)
        return await build_draft(settings, preverifier=pv)

    run_service(build, DraftSettings.from_cli(rest))


if __name__ == "__main__":
    main()
