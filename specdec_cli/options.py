"""The options `specdec serve` and `specdec generate` share, spelled as vLLM users type them.

- `settings_option`: a flag whose default and help are a settings field's (the services read the same fields, so a
  value documented for one process is the value of the other).
- `add_model_options`: the target (positional or `--model` / `--target-model`), the draft, the devices, dtype,
  threads, `--max-num-seqs` and `--max-model-len`: one set of names and defaults for both commands.
- `resolve_models`: the pairing rule both commands follow. The embedded default draft goes with the embedded
  default target only; any other target gets the draft it names, or none (target-only, every request `ar`).
- `--speculative-config JSON` (vLLM's): mapped onto our fields, unknown keys refused in one line naming them.
- `--config FILE` (vLLM's): a YAML or JSON mapping of the same long flags, read before the command line, which
  overrides it.
- `DeprecatedAlias`: an old flag name that still works for one release and says which name replaces it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from pathlib import Path

from specdec.common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec_rpc.settings import DEVICE, DTYPES, ServerSettings


def settings_option(group, cls, field: str, *flags: str, default=None, note: str = "", text: str | None = None,
                    **kw) -> argparse.Action:
    """An option whose default and help are the settings field's (`default`, `note`, `text`: the command's own)."""
    info = cls.model_fields[field]
    value = info.default if default is None else default
    if "choices" not in kw and typing.get_origin(info.annotation) is typing.Literal:
        kw["choices"] = list(typing.get_args(info.annotation))
    if "type" not in kw and "choices" not in kw and value is not None and not isinstance(value, bool):
        kw["type"] = type(value)
    if "choices" not in kw:
        kw.setdefault("metavar", flags[0].lstrip("-").replace("-", "_").upper())
    text = ((info.description or "") if text is None else text).replace("%", "%%")
    text = f"{text}{'; ' if text and note else ''}{note}".strip()
    return group.add_argument(*flags, dest=kw.pop("dest", field), default=value,
                              help=f"{text} (default: %(default)s)" if text else "(default: %(default)s)", **kw)


class DeprecatedAlias(argparse.Action):
    """An old flag kept for one release: it sets the new flag's value and prints one warning naming the new one."""

    def __init__(self, option_strings, dest, replacement: str, **kw):
        self.replacement = replacement
        kw.setdefault("help", f"deprecated: use {replacement}")
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated and will be removed in the next release; use "
              f"{self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated(group, old: str, new: str, dest: str, **kw) -> None:
    group.add_argument(old, dest=dest, action=DeprecatedAlias, replacement=new, default=argparse.SUPPRESS, **kw)


def add_model_options(ap: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """Models, devices and the per-replica limits, as `serve` and `generate` both take them."""
    from draft_service.config import DraftSettings
    from target_service.config import TargetSettings

    if positional:
        ap.add_argument("model", nargs="?", default=None, metavar="TARGET",
                        help=f"the target model: a local Hugging Face directory, a .gguf file, a hub id (from the "
                             f"local cache) or {DEFAULT_TARGET} (default: {DEFAULT_TARGET})")
    m = ap.add_argument_group("models and devices")
    m.add_argument("--model", "--target-model", dest="target_option", default=None, metavar="TARGET",
                   help="the target model, as an option (the same as TARGET)")
    m.add_argument("--draft", "--draft-model", dest="draft", default=None,
                   help=f"the draft model, of the target's tokenizer (default: {DEFAULT_DRAFT} with "
                        f"{DEFAULT_TARGET}; with any other target, none: name one, or the target runs alone)")
    m.add_argument("--no-draft", action="store_true", help="no draft: target-only (every request runs as `ar`)")
    m.add_argument("--preverifier", default=None,
                   help="PACER pre-verifier directory of the draft (default: the shipped one with the shipped draft)")
    settings_option(m, ServerSettings, "device", "--device", note="both models, unless --target-device / "
                                                                  "--draft-device")
    m.add_argument("--target-device", default=None, help="the target's device (default: --device)")
    m.add_argument("--draft-device", default=None, help="the draft's device (default: --device)")
    settings_option(m, ServerSettings, "dtype", "--dtype", choices=list(DTYPES))
    settings_option(m, ServerSettings, "threads", "--threads",
                    text="torch intra-op threads of each model (0: the CPU's cores split between the models on "
                         "the CPU)")
    settings_option(m, DraftSettings, "prompt_lookup_min_ngram", "--prompt-lookup-min-ngram")
    settings_option(m, TargetSettings, "max_context", "--max-model-len")
    settings_option(m, ServerSettings, "max_sessions", "--max-num-seqs",
                    note="per replica; KV memory for all of them (and max-model-len positions each) is allocated "
                         "at start")
    deprecated(m, "--max-context", "--max-model-len", "max_context", type=int)
    deprecated(m, "--max-sessions", "--max-num-seqs", "max_sessions", type=int)
    m.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative config: a JSON object with method (draft_model), model, "
                        "num_speculative_tokens, prompt_lookup_min, disable_by_batch_size, "
                        "draft_tensor_parallel_size (1), and specdec's mode, verify_method, pacer_threshold")


class Models(typing.NamedTuple):
    target: str
    draft: str | None
    devices: dict  # {"target": ..., "draft": ...}
    threads: int  # torch threads of each model (0 resolved)


def resolve_models(args: argparse.Namespace) -> Models:
    """The target, its draft (the pairing rule in the module docstring), the devices and the threads."""
    if args.model and args.target_option and args.model != args.target_option:
        raise ValueError(f"two targets named: {args.model} and --model {args.target_option}; name one")
    target = args.model or args.target_option or DEFAULT_TARGET
    if args.no_draft and args.draft:
        raise ValueError("--no-draft and --draft both given; name a draft or none")
    draft = None if args.no_draft else args.draft or (DEFAULT_DRAFT if target == DEFAULT_TARGET else None)
    devices = {"target": args.target_device or args.device, "draft": args.draft_device or args.device}
    for flag, value in (("--device", args.device), ("--target-device", args.target_device),
                        ("--draft-device", args.draft_device)):
        if value is not None and not DEVICE.match(value):
            raise ValueError(f"{flag} {value}: use cpu, cuda or cuda:N")
    threads = args.threads
    if threads == 0:  # models on the CPU share its cores
        on_cpu = [k for k in (("target", "draft") if draft else ("target",)) if devices[k] == "cpu"]
        threads = max(1, (os.cpu_count() or 2) // max(1, len(on_cpu)))
    return Models(target, draft, devices, threads)


# ---- vLLM's --speculative-config --------------------------------------------------------------------------------
# key -> (our field on the parsed options, the flag that sets it directly)
SPECULATIVE_KEYS = {
    "model": ("draft", "--draft"),
    "num_speculative_tokens": ("gamma", "--num-speculative-tokens"),
    "prompt_lookup_min": ("prompt_lookup_min_ngram", "--prompt-lookup-min-ngram"),
    "disable_by_batch_size": ("spec_off_batch", "--spec-off-batch"),
    "mode": ("default_mode", "--speculative-mode"),
    "verify_method": ("verify_method", "--verify-method"),
    "pacer_threshold": ("pacer_threshold", "--pacer-threshold"),
}
CHECKED_KEYS = {"method": "draft_model", "draft_tensor_parallel_size": 1}  # accepted only with these values


def apply_speculative_config(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str],
                             rename: dict[str, str] | None = None) -> None:
    """Map `--speculative-config` onto the parsed options (`rename`: a field the command keeps under another name).
    A key that the command line also sets with a different value, an unknown key, a key this command has no option
    for, or a value we cannot serve is one error naming it."""
    raw = getattr(args, "speculative_config", None)
    if raw is None:
        return
    try:
        spec = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config: not JSON ({e.msg} at character {e.pos}); pass an object such as "
                         f"'{{\"model\": \"DRAFT\", \"num_speculative_tokens\": 3}}'") from None
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config: must be a JSON object of vLLM's speculative-config keys")
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS) - set(CHECKED_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"known: {', '.join(sorted([*SPECULATIVE_KEYS, *CHECKED_KEYS]))}")
    for key, want in CHECKED_KEYS.items():
        if key in spec and spec[key] != want:
            what = ("specdec drafts with a separate draft model (prompt lookup runs beside it: prompt_lookup_min)"
                    if key == "method" else "each draft replica runs on one device")
            raise ValueError(f"--speculative-config: {key} {spec[key]!r} is not served; {what}: use {want!r}")
    given = {a.dest for a in parser._actions if any(s in argv for s in a.option_strings)}
    dests = {a.dest for a in parser._actions}
    for key, (dest, flag) in SPECULATIVE_KEYS.items():
        if key not in spec:
            continue
        dest = (rename or {}).get(dest, dest)
        if dest not in dests:
            raise ValueError(f"--speculative-config: {key} is a server setting; `specdec serve` takes it")
        value = _typed(parser, dest, spec[key], key)
        if dest in given and getattr(args, dest) != value:
            raise ValueError(f"--speculative-config {key} {spec[key]!r} and {flag} {getattr(args, dest)!r} disagree; "
                             f"give one")
        setattr(args, dest, value)


def _typed(parser: argparse.ArgumentParser, dest: str, value, key: str):
    """The value as the flag of `dest` would have parsed it (its type and choices)."""
    action = next(a for a in parser._actions if a.dest == dest and not isinstance(a, DeprecatedAlias))
    try:
        out = action.type(value) if action.type is not None and value is not None else value
    except (TypeError, ValueError):
        raise ValueError(f"--speculative-config {key} {value!r}: not a valid {action.metavar or dest}") from None
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"--speculative-config {key} {value!r}: choose one of {', '.join(map(str, action.choices))}")
    return out


# ---- --config FILE ----------------------------------------------------------------------------------------------
def add_config_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default=None, metavar="FILE",
                    help="a YAML or JSON file of these options (long names, dashes or underscores: `port: 8080`, "
                         "`speculative-config: {model: ..., num_speculative_tokens: 3}`); the command line wins")


def config_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with the options of its `--config FILE` (YAML or JSON: long flag names, dashes or underscores, to
    values) put before it, so that the command line wins. Unknown keys are one error naming them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    if known.config is None:
        return argv
    path = Path(known.config)
    try:
        text = path.read_text()
    except OSError as e:
        raise FileNotFoundError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    try:
        import yaml  # a superset of JSON: one loader for both

        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not YAML or JSON ({str(e).splitlines()[0]})") from None
    if data is None:
        return rest
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a mapping of option names to values")
    flags = {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}
    out, unknown = [], []
    for key, value in data.items():
        name = "--" + str(key).replace("_", "-")  # `model: ID` is --model, as in vLLM's files
        action = flags.get(name)
        if action is None:
            unknown.append(str(key))
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if bool(value) == isinstance(action, argparse._StoreTrueAction):
                out.append(name)
        elif isinstance(value, list):
            for v in value:
                out += [name, _text(v)]
        else:
            out += [name, _text(value)]
    if unknown:
        raise ValueError(f"--config {path}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"see --help for the names")
    return [*out, *rest]


def _text(value) -> str:
    if isinstance(value, (dict, list)):  # e.g. speculative-config as a nested mapping
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def default_preverifier(args) -> str | None:
    """--preverifier, else the shipped one when the shipped draft is used (and present)."""
    from specdec.decoding.preverifier import default_preverifier_dir  # lazy: imports torch; `specdec --help` loads none

    return args.preverifier or default_preverifier_dir(args.draft)
