"""Every runtime switch is a settings field read once: only the settings modules touch the environment, and the
production code names no absolute path outside the repository."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from specdec.common import settings

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec", "specdec_rpc", "specdec_bench", "specdec_train", "specdec_cli", "coordinator", "draft_service",
            "target_service")
# the modules that may read or write os.environ: the core's runtime settings (read once; prepare_process,
# child_environ, setdefault_environ) and the services' process settings (startup_warnings lists unknown variables)
SETTINGS_MODULES = {"specdec/common/settings.py", "specdec_rpc/settings.py"}
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _production_modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path.relative_to(ROOT).as_posix(), path


def _env_access(tree: ast.AST) -> list[int]:
    """Lines that touch the process environment: os.environ / os.getenv / ... and `from os import environ`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in ENV_NAMES for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_the_settings_modules_touch_the_environment():
    offenders = {}
    for name, path in _production_modules():
        if name in SETTINGS_MODULES:
            continue
        lines = _env_access(ast.parse(path.read_text(), filename=name))
        if lines:
            offenders[name] = lines
    assert not offenders, (f"read the environment through a settings module ({', '.join(sorted(SETTINGS_MODULES))}: "
                           f"a field of specdec.common.settings.RuntimeSettings, or child_environ): {offenders}")


def test_the_scan_sees_every_spelling():
    code = ("import os\nfrom os import getenv\nx = os.environ.get('A')\ny = os.getenv('B')\nz = dict(os.environ)\n"
            "os.environ.setdefault('C', '1')\n")
    assert sorted(_env_access(ast.parse(code))) == [2, 3, 4, 5, 6]


_ABSOLUTE = re.compile(r"""["'](/(?:work|home|tmp|root|mnt|data|scratch|Users)/[^"']*)["']""")


def test_no_absolute_paths_outside_the_repository():
    """A machine's directories are no defaults: data files are flags or settings (/proc and /dev are the kernel's)."""
    found = {}
    for name, path in _production_modules():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.lstrip().startswith("#") and _ABSOLUTE.search(line):
                found.setdefault(name, []).append(i)
    assert not found, found


def test_settings_are_read_once_and_overridden_explicitly(monkeypatch):
    before = settings.get()
    monkeypatch.setenv("SPECDEC_KERNEL_TUNE", "0")
    assert settings.get() is before  # read once: a later change of the environment is not seen
    with settings.override(kernel_tune=not before.kernel_tune) as s:
        assert settings.get() is s and s.kernel_tune is not before.kernel_tune
    assert settings.get() is before
    with pytest.raises(TypeError, match="no such runtime setting"):
        settings.configure(kernel_tuning=False)
    with pytest.raises(ValueError):
        settings.override(onednn_cache_capacity=0).__enter__()
    assert settings.get() is before


@pytest.mark.parametrize("env,field,want", [
    ({"SPECDEC_KERNEL_TUNE": "0"}, "kernel_tune", False),
    ({"SPECDEC_NATIVE": "off"}, "native", False),
    ({"SPECDEC_DECODE_ATTENTION": "false"}, "decode_attention", False),
    ({"SPECDEC_FUSE": "1"}, "fuse", True),
    ({"SPECDEC_CACHE": ""}, "cache", None),
    ({"SPECDEC_CACHE": "/c"}, "cache", Path("/c")),
    ({"CC": "clang"}, "cc", "clang"),
    ({"HF_HUB_OFFLINE": "YES"}, "hf_hub_offline", True),
    ({"HF_HUB_OFFLINE": "maybe"}, "hf_hub_offline", False),  # huggingface_hub's reading: anything else is off
])
def test_each_field_reads_its_variable(monkeypatch, env, field, want):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert getattr(settings.RuntimeSettings(), field) == want


def test_prepare_process_sets_the_cache_sizes_unless_set(monkeypatch):
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    with settings.override(onednn_cache_capacity=128):
        settings.prepare_process()
        env = settings.child_environ(OMP_NUM_THREADS="3")
    assert env["LRU_CACHE_CAPACITY"] == "128" and env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert env["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("first", ["override", "configure"])
def test_override_or_configure_as_a_process_first_read_does_not_deadlock(first):
    """The first read of the settings may happen inside `override` or `configure`, which hold the lock get() takes
    to read them: the lock is reentrant."""
    import subprocess
    import sys

    code = ("from specdec.common import settings\n"
            + ("with settings.override(native=False):\n    assert not settings.get().native\n" if first == "override"
               else "settings.configure(native=False)\nassert not settings.get().native\n"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
