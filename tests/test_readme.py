"""The README's commands, as a stranger would type them: every `specdec` line parses with the real parsers (no flag
that does not exist, no value they refuse), and the ones that run offline on this machine with the default pair
(`generate` in process and through the embedded stack) run as written and print what the README says."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[list[str]]:
    """Every `specdec ...` command in the README's bash blocks, continuation lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("specdec "):
                out.append(shlex.split(line, comments=True)[1:])
    return out


def test_the_readme_names_the_commands_this_test_runs():
    cmds = _commands()
    kinds = [c[0] for c in cmds]
    assert kinds.count("generate") >= 3 and kinds.count("serve") >= 2, cmds


@pytest.mark.parametrize("argv", _commands(), ids=lambda a: " ".join(a)[:60])
def test_every_readme_command_parses(argv, monkeypatch):
    from specdec_cli import main as cli
    from specdec_cli import serve

    monkeypatch.chdir(ROOT)  # the README's paths are relative to the repository (docs/examples/...)
    if argv[0] == "generate":
        args = cli.parse_generate(argv)
        cli._structured(args)  # an @file it names exists and reads
        assert args.prompt
    elif argv[0] == "serve":
        p = serve.plan(serve.parse_args(argv[1:]))
        assert p.target and p.stack["http_port"] == 8000 or "--port" in argv
    else:
        pytest.fail(f"a README command this test does not know: specdec {' '.join(argv)}")


def _runs_offline(argv: list[str]) -> bool:
    """Commands that need nothing but this machine: generate in process or through its own embedded stack."""
    return argv[0] == "generate" and "--coordinator" not in argv


@pytest.mark.parametrize("argv", [a for a in _commands() if _runs_offline(a)], ids=lambda a: " ".join(a)[:60])
def test_readme_generate_commands_run_as_written(argv):
    """The default pair (the package index's target, the shipped draft): each command exits 0 and prints the text
    and the stats line (or, with --json, one JSON object)."""
    p = subprocess.run([sys.executable, "-m", "specdec_cli.main", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    if "--json" in argv:
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["token_ids"] and out["text"] and out["stats"]["mode"], out
    else:
        assert re.search(r"^\[\w+\] \d+ tokens in [\d.]+s", p.stdout, flags=re.M), p.stdout[-2000:]
    if "--json-schema" in argv:  # the answer is JSON that the shipped schema's required fields are in
        schema = json.loads((ROOT / "docs" / "examples" / "person.schema.json").read_text())
        answer = json.loads(p.stdout.split("\n[", 1)[0])
        assert set(schema["required"]) <= set(answer), answer
