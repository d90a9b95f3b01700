"""Model families against transformers (docs/guide/models.md): for each family a tiny random model whose config.json
carries the family's real keys (its RoPE scaling in the key style its public configs use), saved by transformers and
loaded by specdec's loader. fp32 logits within 1e-5 of transformers' forward; greedy `ar` and `sd` (a second tiny
model of the family as the draft, so drafts are rejected and the KV slots roll back) token for token equal to
transformers' greedy `generate`, in process (specdec.engine.Engine, and the `specdec generate --in-process`
command that runs it) and through the served stack (replicas and coordinator over gRPC). Also: each family's
defaults are transformers', the context bounds (sliding window, longrope) refuse past them naming the field,
configs that cannot be served are refused in one line, and the gpu overlay's models (their public config.json
values, tests/data/configs/) load with transformers' RoPE tables."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import grpc
import pytest
import torch

from specdec.common.errors import ContextOverflowError
from specdec.engine import Engine
from specdec.modeling.model import FAMILY_DEFAULTS, ModelConfig, context_limit, load_model_dir, rope_tables
from specdec.scheduling.request import GenerationRequest
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import save_tiny_tokenizer, start_coordinator, start_replica

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = Path(__file__).parent / "data" / "configs"
PROMPT = [5, 17, 3, 42, 9, 28, 11, 7]
N = 16  # new tokens: prompt + N = 24 positions, the Mistral case's whole window
CONTEXT = 64  # positions per session in the engines and replicas (KV slots stay small)

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, hidden_act="silu", rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             attention_dropout=0.0, initializer_range=0.02, use_cache=True)
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False,
             pretraining_tp=1, tie_word_embeddings=False, head_dim=16)
SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1]  # longrope factors, one per frequency (head_dim 16)
LONG = [1.0, 1.3, 2.0, 3.5, 6.0, 9.0, 14.0, 20.0]

# the families' config.json keys (public configs, shrunk): name -> config.json
FAMILIES = {
    # Llama 3.1/3.2/3.3: llama3 RoPE in rope_scaling, rope_theta 500000
    "llama3": {**SMALL, **LLAMA, "max_position_embeddings": 131072, "rope_theta": 500000.0,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    # Llama 2 long-context fine-tunes: the old `type` key
    "llama-linear": {**SMALL, **LLAMA, "max_position_embeddings": 4096, "rope_theta": 10000.0,
                     "rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama-dynamic": {**SMALL, **LLAMA, "max_position_embeddings": CONTEXT, "rope_theta": 10000.0,
                      "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    # transformers 5's rope_parameters key (rope_theta inside it)
    "llama-yarn": {**SMALL, **LLAMA, "max_position_embeddings": 128,
                   "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                       "rope_theta": 10000.0}},
    # Phi-3 style longrope (original_max_position_embeddings at the top level) on a Llama
    "longrope": {**SMALL, **LLAMA, "max_position_embeddings": 128, "original_max_position_embeddings": 32,
                 "rope_theta": 10000.0, "rope_scaling": {"type": "longrope", "short_factor": SHORT,
                                                         "long_factor": LONG}},
    # Qwen2.5 with its documented YaRN setting: q/k/v bias, tied embeddings (0.5B-3B), sliding window off
    "qwen2.5": {**SMALL, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
                "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": 32768,
                "use_sliding_window": False, "max_window_layers": 21,
                "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    # Qwen3: per-head q/k RMSNorm, head_dim wider than hidden / heads, tied embeddings (0.6B-4B)
    "qwen3": {**SMALL, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
              "attention_bias": False, "tie_word_embeddings": True, "max_position_embeddings": 40960,
              "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
              "max_window_layers": 28},
    # Mistral 7B v0.1: sliding-window attention (4096 there; 24 here, prompt + N fills it exactly)
    "mistral": {**SMALL, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "head_dim": 16,
                "tie_word_embeddings": False, "max_position_embeddings": 128, "rope_theta": 10000.0,
                "sliding_window": len(PROMPT) + N},
}


# ----------------------------------------------------------------------------------------------------------------
# tiny random models of each family, saved by transformers with the family's config.json

def hf_model(raw: dict, seed: int, layers: int | None = None):
    """transformers' model of this config.json, random weights at a scale where greedy choices are clear-cut."""
    import transformers

    raw = copy.deepcopy(raw) | ({"num_hidden_layers": layers} if layers else {})
    arch = raw["architectures"][0]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config")).from_dict(copy.deepcopy(raw))
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # they start at ones: make the test see which weight goes where
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "embed_tokens" in name or "lm_head" in name:  # logits of about unit scale: |diff| <= 1e-5 holds
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)  # with room on any host, and greedy choices stay clear
            else:
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None  # generate N tokens, whatever they are
    model.generation_config.pad_token_id = 0
    return model, raw


_BUILT: dict[str, tuple] = {}


def family(name: str, root: Path):
    """(transformers target, its dir, transformers draft, its dir): the draft a 1-layer model of the family, other
    weights. The config.json on disk is the family's own key style, not transformers' re-serialization."""
    if name not in _BUILT:
        out = []
        for role, seed, layers in (("target", 1, None), ("draft", 2, 1)):
            model, raw = hf_model(FAMILIES[name], seed, layers)
            d = root / name / role
            model.save_pretrained(d)
            (d / "config.json").write_text(json.dumps(raw))
            out += [model, d]
        _BUILT[name] = tuple(out)
    return _BUILT[name]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    yield tmp_path_factory.mktemp("families")
    _BUILT.clear()


def hf_greedy(model, n: int = N) -> list[int]:
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(PROMPT):].tolist()


# ----------------------------------------------------------------------------------------------------------------
# parity

@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_rope_match_transformers(name, root):
    """A prompt in one forward, then the rest through the KV slots: transformers' logits within 1e-5 (fp32), and
    transformers' RoPE tables (its rotary embedding's cos/sin, attention factor included)."""
    hf, tdir, _, _ = family(name, root)
    m = load_model_dir(tdir, dtype="float32")
    ids = torch.tensor([PROMPT + [60, 1, 33, 8, 70, 21, 4, 90]])
    with torch.no_grad():
        ref = hf(ids).logits
        hf_cos, hf_sin = hf.model.rotary_emb(ref, torch.arange(ids.shape[1])[None])
    kv = m.new_kv_slots(2, 32)
    a, _ = m(ids[:, :len(PROMPT)], torch.arange(len(PROMPT))[None], torch.tensor([1]), kv)
    b, _ = m(ids[:, len(PROMPT):], torch.arange(len(PROMPT), ids.shape[1])[None], torch.tensor([1]), kv)
    diff = (torch.cat([a, b], 1) - ref).abs().max().item()
    print(f"{name}: logits max-abs-diff {diff:.2e}")
    assert diff <= 1e-5, (name, diff)
    cos, sin = rope_tables(m.config, ids.shape[1])
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=0)
    c = m.config
    assert (c.attention_bias, c.qk_norm) == (name == "qwen2.5", name == "qwen3")
    assert c.tie_word_embeddings == (name in ("qwen2.5", "qwen3"))
    if c.tie_word_embeddings:
        assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    if name not in ("qwen3", "mistral", "llama-dynamic"):  # the scaling matters here: plain RoPE is off
        plain = load_model_dir(tdir, dtype="float32")
        plain.config.rope_parameters = None
        p, _ = plain(ids, torch.arange(ids.shape[1])[None], torch.tensor([0]), plain.new_kv_slots(1, 32))
        assert (p - ref).abs().max().item() > 1e-3, name


def assert_rejected_some(stats) -> None:
    """Some drafted token was verified and rejected: a verify wrote K/V past the accepted tokens, rolled back."""
    assert stats.verified_draft_tokens > stats.accepted_tokens, stats


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_in_process_equals_transformers_generate(name, root):
    hf, tdir, _, ddir = family(name, root)
    ref = hf_greedy(hf)
    eng = Engine(load_model_dir(tdir, dtype="float32"), load_model_dir(ddir, dtype="float32", role="draft"),
                 max_sessions=2, max_context=CONTEXT)
    try:
        assert eng.generate(GenerationRequest(PROMPT, N, mode="ar")).token_ids == ref, name
        for gamma in (2, 4):
            out = eng.generate(GenerationRequest(PROMPT, N, mode="sd", gamma=gamma))
            assert out.token_ids == ref, (name, gamma)
            assert_rejected_some(out.stats)
    finally:
        eng.close()


@pytest.mark.parametrize("name", FAMILIES)
async def test_greedy_served_equals_transformers_generate(name, root):
    hf, tdir, _, ddir = family(name, root)
    ref = hf_greedy(hf)
    t = await start_replica("target", load_model_dir(tdir, dtype="float32"), max_context=CONTEXT, max_sessions=2)
    d = await start_replica("draft", load_model_dir(ddir, dtype="float32", role="draft"), max_context=CONTEXT,
                            max_sessions=2)
    coord = await start_coordinator(t.endpoint, d.endpoint)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}")
    try:
        stub = gg.GenerationServiceStub(ch)
        for mode in ("ar", "sd"):
            r = await stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=N, mode=mode,
                                                      gamma=4, ignore_eos=True))
            assert list(r.token_ids) == ref, (name, mode)
            if mode == "sd":
                assert_rejected_some(r.stats)
    finally:
        await ch.close()
        for app in (coord, d, t):
            await app.shutdown(0)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_specdec_generate_in_process_equals_transformers_generate(name, root, capsys):
    """The command itself: `specdec generate TEXT --in-process --mode ar|sd --json` (a character tokenizer in the
    model directories), against transformers' `generate` of the same token ids, ending at the config's EOS."""
    from specdec.text.tokenizer import encode_prompt, load_tokenizer
    from specdec_cli.main import main

    hf, tdir, _, ddir = family(name, root)
    for d in (tdir, ddir):
        save_tiny_tokenizer(d)
    text = "cats nap"  # at most 8 tokens: with N more, within the Mistral case's window
    prompt = encode_prompt(load_tokenizer(tdir), prompt=text)  # the ids the command generates from
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False)[0, len(prompt):].tolist()
    eos = FAMILIES[name]["eos_token_id"]
    ref = ref[:ref.index(eos) + 1] if eos in ref else ref
    threads = torch.get_num_threads()
    try:
        for mode in ("ar", "sd"):
            rc = main(["generate", text, "--in-process", "--mode", mode, "--json", "--max-new-tokens", str(N),
                       "--dtype", "float32", "--target-model", str(tdir), "--draft-model", str(ddir)])
            printed = capsys.readouterr()
            assert rc == 0, printed.err
            out = json.loads(printed.out)
            assert out["token_ids"] == ref, (name, mode, out["token_ids"], ref)
            if mode == "sd":
                assert out["stats"]["verified_draft_tokens"] > out["stats"]["accepted_tokens"], out["stats"]
    finally:
        torch.set_num_threads(threads)  # the CLI pins its thread to 1


# ----------------------------------------------------------------------------------------------------------------
# where a family is served exactly, and what is refused

def test_sliding_window_bounds_the_context_and_a_longer_request_is_refused_naming_it(root):
    """Within the window sliding-window attention is full causal attention (the parity tests fill it exactly);
    past it transformers' logits change, and specdec refuses the request, naming sliding_window."""
    hf, tdir, _, ddir = family("mistral", root)
    window = FAMILIES["mistral"]["sliding_window"]
    m = load_model_dir(tdir, dtype="float32")
    assert context_limit(m.config) == (window, "sliding_window")
    ids = torch.arange(window + 4)[None] % 90 + 3
    full = copy.deepcopy(hf)
    full.config.sliding_window = None
    with torch.no_grad():
        windowed, unwindowed = hf(ids).logits, full(ids).logits
    torch.testing.assert_close(windowed[:, :window], unwindowed[:, :window], atol=1e-5, rtol=0)
    assert not torch.allclose(windowed[:, window:], unwindowed[:, window:])
    eng = Engine(m, load_model_dir(ddir, dtype="float32", role="draft"), max_sessions=1, max_context=CONTEXT)
    try:
        assert eng.target_worker.max_context == window
        with pytest.raises(ContextOverflowError, match="sliding_window"):
            eng.generate(GenerationRequest(PROMPT, N + 1, mode="sd"))
    finally:
        eng.close()


async def test_a_served_request_past_the_window_is_refused_naming_it(root):
    _, tdir, _, ddir = family("mistral", root)
    t = await start_replica("target", load_model_dir(tdir, dtype="float32"), max_context=CONTEXT, max_sessions=2)
    d = await start_replica("draft", load_model_dir(ddir, dtype="float32", role="draft"), max_context=CONTEXT,
                            max_sessions=2)
    coord = await start_coordinator(t.endpoint, d.endpoint)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await gg.GenerationServiceStub(ch).Generate(g.GenerateRequest(prompt_token_ids=PROMPT, mode="sd",
                                                                          max_new_tokens=N + 1, ignore_eos=True))
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and "sliding_window" in e.value.details()
    finally:
        await ch.close()
        for app in (coord, d, t):
            await app.shutdown(0)


def test_longrope_is_served_up_to_its_original_length(root):
    """transformers switches every position to the long factors once a sequence passes the original length; a
    cache of keys rotated with the short ones cannot follow, so that length bounds the context."""
    _, tdir, _, _ = family("longrope", root)
    m = load_model_dir(tdir, dtype="float32")
    assert context_limit(m.config) == (32, "original_max_position_embeddings")
    eng = Engine(m, None, max_sessions=1, max_context=CONTEXT)
    try:
        with pytest.raises(ContextOverflowError, match="original_max_position_embeddings"):
            eng.generate(GenerationRequest(PROMPT, 32, mode="ar"))
    finally:
        eng.close()


def test_dynamic_rope_is_plain_rope_up_to_max_position_embeddings():
    """transformers' dynamic NTK starts scaling only past max_position_embeddings, which bounds the context."""
    c = ModelConfig.from_hf(FAMILIES["llama-dynamic"])
    plain = copy.deepcopy(c)
    plain.rope_parameters = None
    assert context_limit(c) == (CONTEXT, "max_position_embeddings")
    for a, b in zip(rope_tables(c, CONTEXT), rope_tables(plain, CONTEXT)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_own_serialization_reads_the_same(name):
    """The config as transformers 5 writes it (rope_parameters, rope_theta inside, every default spelled out) gives
    the same model as the family's published key style."""
    import transformers

    raw = FAMILIES[name]
    cls = getattr(transformers, raw["architectures"][0].replace("ForCausalLM", "Config"))
    rewritten = json.loads(cls.from_dict(copy.deepcopy(raw)).to_json_string())
    assert "rope_parameters" in rewritten
    assert ModelConfig.from_hf(rewritten) == ModelConfig.from_hf(raw)


@pytest.mark.parametrize("arch", FAMILY_DEFAULTS)
def test_family_defaults_are_transformers(arch):
    """A config.json that leaves the optional fields out gets transformers' values for its family."""
    import transformers

    raw = {"architectures": [arch], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4}
    ours = ModelConfig.from_hf(raw)
    theirs = getattr(transformers, arch.replace("ForCausalLM", "Config")).from_dict(copy.deepcopy(raw))
    for key in ("rms_norm_eps", "max_position_embeddings", "num_key_value_heads", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 64 // 4)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    window = getattr(theirs, "sliding_window", None)
    if "sliding_attention" not in (getattr(theirs, "layer_types", None) or ["sliding_attention"]):
        window = None
    assert ours.sliding_window == window
    assert context_limit(ours)[0] == min(theirs.max_position_embeddings, window or theirs.max_position_embeddings)


def test_qwen_sliding_window_counts_only_where_a_layer_slides():
    qwen = {**FAMILIES["qwen2.5"], "rope_scaling": None}
    assert ModelConfig.from_hf(qwen).sliding_window is None  # use_sliding_window false: every layer full
    on = ModelConfig.from_hf({**qwen, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1})
    assert context_limit(on) == (16, "sliding_window")
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True, "sliding_window": 16,
                                "max_window_layers": 2}).sliding_window is None  # no layer past the first 2


BASE = FAMILIES["llama3"]
REFUSED = [
    ({**BASE, "architectures": ["GPT2LMHeadModel"]}, "architectures='GPT2LMHeadModel'"),
    ({**BASE, "rope_scaling": {"rope_type": "su", "factor": 2.0}}, "rope_scaling.rope_type='su'"),
    ({**BASE, "rope_scaling": None, "rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 3, 3]}},
     "rope_parameters.rope_type='mrope'"),
    ({**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "no 'low_freq_factor'"),
    ({**BASE, "rope_scaling": {"type": "linear", "factor": "2"}}, "rope_parameters={"),
    ({**BASE, "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "rope_scaling.short_factor has 1 values; head_dim 16 needs 8"),
    ({k: v for k, v in BASE.items() if k != "hidden_size"}, "no 'hidden_size'"),
    ({**BASE, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({**BASE, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({**BASE, "attention_bias": True}, "attention_bias=True"),
    ({**BASE, "mlp_bias": True}, "mlp_bias=True"),
    ({**FAMILIES["qwen3"], "attention_bias": True}, "attention_bias=True"),
]


@pytest.mark.parametrize("raw,words", REFUSED, ids=[w for _, w in REFUSED])
def test_configs_that_cannot_be_served_exactly_are_refused_in_one_line(raw, words):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(raw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_specdec_generate_reports_a_refused_config_in_one_line(tmp_path, capsys):
    """`specdec generate --in-process` with an unknown RoPE type: one line on stderr, exit status 1."""
    from specdec_cli.main import main

    d = save_tiny_tokenizer(tmp_path / "m")
    (d / "config.json").write_text(json.dumps({**BASE, "rope_scaling": {"rope_type": "su", "factor": 2.0}}))
    threads = torch.get_num_threads()
    try:
        rc = main(["generate", "hi", "--in-process", "--mode", "ar", "--target-model", str(d)])
    finally:
        torch.set_num_threads(threads)  # the CLI pins its thread to 1
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("error: rope_scaling.rope_type='su'") and "\n" not in err, err


# ----------------------------------------------------------------------------------------------------------------
# the gpu overlay's pair: their public config.json values

def overlay_models() -> dict[str, str]:
    text = (ROOT / "deploy" / "overlays" / "gpu" / "kustomization.yaml").read_text()
    return {role: re.search(rf"{role}_MODEL=(\S+)", text).group(1) for role in ("TARGET", "DRAFT")}


@pytest.mark.parametrize("role", ["TARGET", "DRAFT"])
def test_gpu_overlay_models_load_with_transformers_rope(role):
    """The loader accepts Llama-3.1-8B-Instruct and Llama-3.2-1B-Instruct as published (no weights) and their RoPE
    tables are transformers' rotary embedding's, across the llama3 scaling's bands and the whole context."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hub_id = overlay_models()[role]
    raw = json.loads((CONFIGS / (hub_id.replace("/", "__") + ".json")).read_text())
    c = ModelConfig.from_hf(raw)
    assert c.rope_parameters["rope_type"] == "llama3" and context_limit(c) == (131072, "max_position_embeddings")
    assert (c.vocab_size, c.head_dim, c.bos_token_id, c.eos_token_id) == (128256, 128 if role == "TARGET" else 64,
                                                                          128000, [128001, 128008, 128009])
    assert c.tie_word_embeddings == (role == "DRAFT")
    positions = torch.tensor([0, 1, 2, 7, 100, 1000, 4095, 8191, 8192, 20000, 65535, 131071])
    hf_cos, hf_sin = LlamaRotaryEmbedding(LlamaConfig.from_dict(copy.deepcopy(raw)))(
        torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = rope_tables(c, 131072)
    torch.testing.assert_close(cos[positions], hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[positions], hf_sin[0], atol=1e-6, rtol=0)


def test_gpu_overlay_pair_shares_a_vocabulary():
    cfgs = {role: ModelConfig.from_hf(json.loads((CONFIGS / (m.replace("/", "__") + ".json")).read_text()))
            for role, m in overlay_models().items()}
    assert cfgs["TARGET"].vocab_size == cfgs["DRAFT"].vocab_size
    assert cfgs["TARGET"].eos_token_id == cfgs["DRAFT"].eos_token_id
