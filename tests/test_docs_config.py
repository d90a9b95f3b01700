"""docs/guide/configuration.md is the configuration reference: it must name every setting of the three server
processes (with its environment variable and default), every flag of the `specdec` subcommands it documents
(with its default), and every environment variable the code reads, and nothing that does not exist."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from specdec_cli.options import DeprecatedAlias

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "guide" / "configuration.md"
PACKAGES = ("specdec", "specdec_rpc", "specdec_cli", "specdec_bench", "specdec_train", "coordinator",
            "draft_service", "target_service")

SETTINGS_ROW = re.compile(r"^\| `(--[a-z0-9.-]+)` \| `([A-Z0-9_*]+)` \| (.+?) \| (.+) \|$")
CLI_ROW = re.compile(r"^\| `(--[a-z0-9-]+)`(?: \(`-[a-z]`\))? \| (.+?) \| (.+) \|$")
PROSE_DEFAULTS = ("unset", "required", "all")


def _text() -> str:
    return DOC.read_text()


def _classes():
    from coordinator.config import CoordinatorSettings
    from draft_service.config import DraftSettings
    from target_service.config import TargetSettings

    return {"draft": DraftSettings, "target": TargetSettings, "coordinator": CoordinatorSettings}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from specdec_bench.cli import build_parser as bench_parser
    from specdec_cli.batch import build_parser as batch_parser
    from specdec_cli.main import build_parser
    from specdec_cli.serve import build_parser as serve_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {"serve": serve_parser(), "generate": sub.choices["generate"], "batch": batch_parser(),
            "bench": bench_parser()}


def _tables(marker: str) -> list[tuple[list[str], list[str]]]:
    """(the marker's words, the table's body lines) for every `<!-- marker: ... -->` table."""
    lines = _text().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.fullmatch(rf"<!-- {marker}: ([a-z ]+) -->", line.strip())
        if not m:
            continue
        body = []
        for row in lines[i + 3:]:  # the header and its rule follow the marker
            if not row.startswith("|"):
                break
            body.append(row)
        out.append((m.group(1).split(), body))
    return out


def _fields(cls) -> dict[str, object]:
    """Every setting as its dotted name (TLS's nested fields as tls.<name>) -> default."""
    out = {}
    for name, f in cls.model_fields.items():
        if name == "tls":
            for sub, sf in type(f.default).model_fields.items():
                out[f"tls.{sub}"] = sf.default
        else:
            out[name] = f.default
    return out


def _parse_default(cell: str):
    """A table's default cell: the first backticked value (unset → None, "" → the empty string)."""
    cell = cell.strip()
    if cell.startswith("unset"):
        return None
    m = re.match(r"`([^`]*)`", cell)
    assert m, f"a default must start with a backticked value or 'unset': {cell!r}"
    v = m.group(1)
    if v == '""':
        return ""
    if v in ("true", "false"):
        return v == "true"
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def _same(doc, code) -> bool:
    if isinstance(code, bool) or isinstance(doc, bool):
        return doc is code
    if isinstance(code, (int, float)) and isinstance(doc, (int, float)):
        return float(doc) == float(code)
    if isinstance(code, (list, tuple)):
        return doc == ("[]" if not code else ",".join(map(str, code)))
    return doc == code


def test_every_setting_is_documented_with_its_env_var_and_default():
    classes = _classes()
    documented: dict[str, list[str]] = {k: [] for k in classes}
    tables = _tables("settings")
    assert len(tables) >= 6
    for owners, body in tables:
        assert body and set(owners) <= set(classes), owners
        for row in body:
            m = SETTINGS_ROW.match(row)
            assert m, f"not a settings row: {row}"
            flag, env, default, _ = m.groups()
            name = flag[2:].replace("-", "_")
            suffix = name.upper().replace(".", "__")
            for owner in owners:
                cls = classes[owner]
                fields = _fields(cls)
                assert name in fields, f"{flag}: {cls.__name__} has no such setting"
                prefix = cls.model_config["env_prefix"]
                want = f"*_{suffix}" if env.startswith("*_") else prefix + suffix
                assert env == want, (flag, env, want)
                assert _same(_parse_default(default), fields[name]), (owner, flag, default, fields[name])
                documented[owner].append(name)
    for owner, cls in classes.items():
        names = documented[owner]
        assert len(names) == len(set(names)), f"{owner}: a setting documented twice"
        assert set(names) == set(_fields(cls)), (owner, sorted(set(_fields(cls)) - set(names)))


@pytest.mark.parametrize("command", ["serve", "generate", "batch", "bench"])
def test_every_cli_flag_is_documented_with_its_default(command):
    parser = _parsers()[command]
    tables = [body for words, body in _tables("cli") if words == [command]]
    assert len(tables) == 1, command
    documented = {}
    for row in tables[0]:
        m = CLI_ROW.match(row)
        assert m, f"not a flag row: {row}"
        documented[m.group(1)] = m.group(2)
    actions = {max(a.option_strings, key=len): a for a in parser._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)}
    assert set(documented) == set(actions), (sorted(set(actions) - set(documented)),
                                              sorted(set(documented) - set(actions)))
    for flag, cell in documented.items():
        action = actions[flag]
        if cell.startswith("deprecated: "):  # an old name kept for one release: it warns and names the new one
            assert isinstance(action, DeprecatedAlias) and f"`{action.replacement}`" in cell, (command, flag)
        elif cell.startswith("required"):
            assert action.required, flag
        elif cell.startswith("all"):
            assert list(action.default) == list(action.choices), flag
        elif cell.startswith("unset"):
            assert action.default is None, flag
        elif flag == "--api-key" and command == "generate":
            assert "SPECDEC_API_KEY" in cell  # the environment's key, read when the parser is built
        else:
            assert _same(_parse_default(cell), action.default), (command, flag, cell, action.default)


def _known_flags() -> set[str]:
    flags = {"--help", "--version"}
    for cls in _classes().values():
        for name, default in _fields(cls).items():
            flag = "--" + name.replace("_", "-")
            flags.add(flag)
            if isinstance(default, bool):
                flags.add("--no-" + flag[2:])
    for parser in _parsers().values():
        for a in parser._actions:
            flags.update(s for s in a.option_strings if s.startswith("--"))
    return flags


def test_the_doc_names_no_flag_that_does_not_exist():
    known = _known_flags()
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9.-]*[a-z0-9]", _text()))
    assert named <= known, sorted(named - known)


def _runtime_env() -> dict[str, object]:
    """The process environment variables and their defaults: the core's RuntimeSettings (specdec/common/settings.py),
    the native libraries' variables specdec sets, and any other variable the packages read directly."""
    out: dict[str, object] = {}
    try:
        from specdec.common.settings import RuntimeSettings
    except ImportError:
        RuntimeSettings = None
    if RuntimeSettings is not None:
        prefix = RuntimeSettings.model_config.get("env_prefix", "")
        for name, f in RuntimeSettings.model_fields.items():
            alias = f.validation_alias
            env = alias.choices[0] if alias is not None else prefix + name.upper()
            out[env] = f.default
    pat = re.compile(r"os\.environ\.(?:get|setdefault)\(\s*\"([A-Z][A-Z0-9_]*)\"|\b([A-Z][A-Z0-9_]*_CAPACITY)=")
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for a, b in pat.findall(path.read_text()):
                out.setdefault(a or b, ...)  # read directly: no default to compare
    return out


def test_env_vars_in_the_doc_exist_and_every_one_read_is_documented():
    text = _text()
    env_names = {cls.model_config["env_prefix"] + n.upper().replace(".", "__")
                 for cls in _classes().values() for n in _fields(cls)}
    named = set(re.findall(r"\b(?:DRAFT|TARGET|COORDINATOR)_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert named <= env_names, sorted(named - env_names)
    runtime = _runtime_env()
    section = text[text.index("## Process environment variables"):text.index("## The `specdec` command")]
    rows = dict(re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \| (.+?) \|", section, flags=re.M))
    assert set(rows) == set(runtime), (sorted(set(runtime) - set(rows)), sorted(set(rows) - set(runtime)))
    for env, cell in rows.items():
        default = runtime[env]
        if default is ... or cell.startswith("set from"):
            continue
        doc = _parse_default(cell)
        if isinstance(default, bool):
            doc = {1: True, 0: False}.get(doc, doc)
        assert _same(doc, default), (env, cell, default)
    specdec_named = set(re.findall(r"\bSPECDEC_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert specdec_named <= set(runtime), sorted(specdec_named - set(runtime))


def test_every_path_the_doc_names_exists():
    """Repository paths in backticks and relative links must exist (links to other docs may be written by
    their owners later; those are checked from the docs tree's root)."""
    text = _text()
    for path in re.findall(r"`((?:specdec|specdec_rpc|specdec_cli|specdec_bench|specdec_train|coordinator|"
                           r"draft_service|target_service|deploy|tests|scripts)/[\w./-]*)`", text):
        assert (ROOT / path).exists(), path
    for link in re.findall(r"\]\((\.\./[^)#]+)", text):
        assert (DOC.parent / link).resolve().is_relative_to(ROOT / "docs"), link


USER_DOCS = ("README.md", "docs/guide/quickstart.md", "docs/guide/features.md", "docs/api/grpc.md",
             "docs/api/openai.md")


def _commands(prefix: str) -> list[tuple[str, str]]:
    """(doc, command line) for every line of a fenced block in the user docs that runs `prefix` (continuation
    lines joined, comments dropped)."""
    import shlex

    out = []
    for doc in USER_DOCS:
        text = (ROOT / doc).read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"^(?:[A-Z_]+=\S+\s+)*", "", line.strip())  # leading VAR=value assignments
                line = re.sub(r"^\.venv/bin/", "", line)
                if line.startswith(prefix + " "):
                    words = shlex.split(line, comments=True)
                    out.append((doc, words))
    return out


def test_every_specdec_command_in_the_user_docs_parses():
    """`specdec ...` lines in the README, the guides and the API docs name subcommands and flags that exist
    (`--help` appended: argparse checks everything before it, prints help and exits 0)."""
    from specdec_cli import main as cli

    commands = _commands("specdec")
    assert len(commands) >= 10
    for doc, words in commands:
        with pytest.raises(SystemExit) as e:
            cli.main(words[1:] + ["--help"])
        assert e.value.code in (0, None), (doc, words)


def test_every_service_command_in_the_user_docs_parses():
    """`python -m draft_service / target_service / coordinator ...` lines name flags those processes take."""
    classes = {"draft_service": "draft", "target_service": "target", "coordinator": "coordinator"}
    commands = _commands("python")
    checked = 0
    for doc, words in commands:
        if words[:2] != ["python", "-m"] or words[2] not in classes:
            continue
        flags = {"--" + n.replace("_", "-") for n in _fields(_classes()[classes[words[2]]])}
        named = [w.split("=")[0] for w in words[3:] if w.startswith("--")]
        assert set(named) <= flags, (doc, words)
        checked += 1
    assert checked >= 3
