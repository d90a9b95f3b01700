"""Build hook: the gRPC stubs (specdec_rpc/pb/*_pb2*.py[i]) are generated from proto/ whenever the package is built.

Everything else about the package is declared in pyproject.toml. `pip install .` (a wheel) writes the stubs into the
build tree, so the installed package has them; `pip install -e .` (what `make` runs) writes them into
specdec_rpc/pb/ of the checkout, where the editable install reads them. Both run scripts/gen_protos.py's
`generate`, with the grpcio-tools that [build-system].requires pins (the stubs then import on any grpcio from that
version on: the runtime range in pyproject.toml starts there). The stubs are never committed.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    """build_py, then the gRPC stubs: into the build tree, or into the checkout for an editable install."""

    def run(self):
        super().run()
        gen = _gen_protos()
        editable = getattr(self, "editable_mode", False)
        out = gen.OUT_DIR if editable else Path(self.build_lib) / "specdec_rpc" / "pb"
        written = gen.regenerate(out)
        print(f"specdec: generated {len(written)} gRPC stub files into {out}")


setup(cmdclass={"build_py": BuildPyWithStubs})
