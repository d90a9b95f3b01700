"""Offline checks of the container image recipe (Dockerfile, .dockerignore): non-root, the right ports, no weights or
secrets baked in, a build context that holds what the Dockerfile copies and runs, and a runtime without the dev
extras. What they do not prove: that the image builds (no Docker engine here)."""
from __future__ import annotations

import re
import subprocess
import tomllib

import pytest

from specdec.common import defaults
from tests.test_deploy import INSTALL_HINT, ROOT, _tool

# ---------------------------------------------------------------- Dockerfile

DOCKERFILE = ROOT / "Dockerfile"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_runtime_is_non_root_and_exposes_default_ports():
    ins = dockerfile_instructions()
    last_from = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    final = ins[last_from:]
    users = [arg for op, arg in final if op == "USER"]
    assert users, "final stage must set USER"
    assert users[-1].split(":")[0] not in ("root", "0")
    exposed = {int(p.split("/")[0]) for op, arg in final if op == "EXPOSE" for p in arg.split()}
    assert exposed == {defaults.COORDINATOR_PORT, defaults.COORDINATOR_HTTP_PORT, defaults.DRAFT_PORT, defaults.TARGET_PORT,
                       defaults.COORDINATOR_METRICS_PORT, defaults.DRAFT_METRICS_PORT, defaults.TARGET_METRICS_PORT}
    assert not any(op == "HEALTHCHECK" for op, _ in ins), "Kubernetes ignores HEALTHCHECK; probes live in deploy/"
    env = " ".join(arg for op, arg in final if op == "ENV")
    assert "XDG_CACHE_HOME=/models/cache" in env
    assert any(op == "VOLUME" and "/models/cache" in arg for op, arg in final)


def test_dockerfile_has_cpu_and_cuda_variants():
    ins = dockerfile_instructions()
    stages = {arg.split()[-1] for op, arg in ins if op == "FROM" and " AS " in arg.upper()}
    assert {"torch-cpu", "torch-cuda"} <= stages
    assert any(op == "ARG" and arg.startswith("VARIANT=") for op, arg in ins)
    (build,) = [arg for op, arg in ins if op == "RUN" and "pip install --no-cache-dir -c constraints.txt ." in arg]
    assert "from specdec_rpc.pb import" in build


def test_dockerfile_bakes_in_no_weights_or_secrets():
    weights = re.compile(r"\.(gguf|safetensors|bin|pt|pth|ckpt)\b|(^|\s)/?models?/|\.pem\b|\.key\b|\.crt\b")
    for op, arg in dockerfile_instructions():
        if op in ("COPY", "ADD"):
            assert not weights.search(arg), f"{op} {arg}"
            assert "--from=" in arg or not arg.split()[0].startswith("http"), f"{op} {arg}"
        if op == "RUN":
            assert "resolve_model" not in arg, "models are fetched at pod start, not at build time"
    ignore = (ROOT / ".dockerignore").read_text().split()
    for pattern in (".venv", ".git", "**/*.gguf", "**/*.safetensors", "**/*.pem", "**/*.key"):
        assert pattern in ignore, f".dockerignore lacks {pattern}"


def test_hadolint():
    exe = _tool("hadolint")
    if exe is None:
        pytest.skip(f"hadolint not found; {INSTALL_HINT}")
    out = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- image build context

def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path (or one of its parent directories) decides; `!`
    re-includes. `**` spans directories, `*` and `?` stay within one."""
    def regex(pat: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pat):
            if pat.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pat.startswith("**", i):
                out, i = out + ".*", i + 2
            else:
                out += {"*": "[^/]*", "?": "[^/]"}.get(pat[i], re.escape(pat[i]))
                i += 1
        return re.compile(out)

    parts = rel.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        rx = regex(pat.lstrip("!").strip("/"))
        if any(rx.fullmatch(c) for c in candidates):
            ignored = not negate
    return ignored


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def test_build_context_holds_what_the_dockerfile_copies_and_runs():
    """Every COPY source is in the build context (not excluded by .dockerignore), and every script a RUN executes
    was copied. The image once ran `make proto`, whose rule needs scripts/gen_protos.py, which was neither copied nor
    in the context."""
    patterns = dockerignore_patterns()
    copied = []
    for op, arg in dockerfile_instructions():
        if op != "COPY" or "--from=" in arg:
            continue
        *sources, _dest = arg.split()
        for src in sources:
            path = ROOT / src
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            kept = [f for f in files if not dockerignored(str(f.relative_to(ROOT)), patterns)]
            assert kept, f"COPY {src}: nothing of it is in the build context (.dockerignore)"
            copied.append(src.rstrip("/"))
    for op, arg in dockerfile_instructions():
        if op == "RUN":
            runs_make = re.search(r"(^|&&|;|\|\|)\s*make\b", arg)
            assert not runs_make, f"RUN runs make (its `install` target adds the dev extras): {arg}"
            for script in re.findall(r"python\s+(\S+\.py)", arg):
                copies_it = any(script == c or script.startswith(c + "/") for c in copied)
                assert copies_it, f"RUN runs {script}, which no COPY brings in"
                assert not dockerignored(script, patterns), f"{script} is excluded from the build context"
    assert dockerignored("tests/test_deploy.py", patterns) and dockerignored("scripts/bench.py", patterns)
    assert dockerignored("models/x.safetensors", patterns) and not dockerignored("specdec/assets/a.safetensors",
                                                                                 patterns)


def test_dockerfile_installs_the_runtime_without_dev_extras():
    """The project is installed non-editable from the build context, at constraints.txt's versions and without its
    extras (pytest, kubectl, matplotlib, ...); the build hook (setup.py) generates the stubs, so it and what it
    reads are copied in, and the installed package is checked to import them."""
    (build,) = [arg for op, arg in dockerfile_instructions() if op == "RUN" and "pip install --no-cache-dir -c" in arg]
    assert "pip install --no-cache-dir -c constraints.txt ." in build
    assert "[" not in build.split("import")[0] and "-e " not in build
    assert "from specdec_rpc.pb import" in build
    copied = " ".join(arg for op, arg in dockerfile_instructions() if op == "COPY")
    for needed in ("setup.py", "constraints.txt", "LICENSE", "proto/", "scripts/gen_protos.py"):
        assert needed in copied, f"the build hook needs {needed} in /src"


def test_dockerfile_copies_every_package_the_project_installs():
    """`pip install .` in the image installs the packages pyproject.toml names; each must be in /src by then, or the
    image lacks it (the services import specdec_rpc, the `specdec` command specdec_cli)."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    copied = {arg.split()[0].rstrip("/") for op, arg in dockerfile_instructions() if op == "COPY" and "--from=" not in arg}
    assert packages <= copied, f"the Dockerfile copies none of {sorted(packages - copied)}"
