"""PACER with the draft on an accelerator. The pre-verifier runs on the host; a GPU draft's pre-verifier features
stay on its device while it drafts a block and reach the host in one copy per scored block
(`specdec.workers.drafting.CallFeatures.block`), never with a host read per drafted token.

Checked on CPU with `OnDevice`, a tensor standing in for one on a GPU: the draft's forward outputs are wrapped in
it, and whatever is computed from them stays one. Like a CUDA tensor it reports a non-CPU device, refuses NumPy
(`.numpy()`, `np.asarray`) and any op that mixes it with a host tensor of one dimension or more; its host reads
(`.item()`, `float()`, `int()`, `.tolist()`, `bool()`, `.cpu()` / `.to("cpu")`) are counted. And on a real CUDA
device where there is one (marked `cuda`)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from specdec.decoding.preverifier import build_random_preverifier
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.stop import DraftFeatures, PreverifierStop
from specdec.engine import Engine
from specdec.scheduling.request import GenerationRequest
from tests.helpers_models import build_tiny_model

torch.set_num_threads(1)

_T = torch.Tensor
_READS = {_T.item: "item", _T.tolist: "tolist", _T.__float__: "float", _T.__int__: "int", _T.__index__: "index",
          _T.__bool__: "bool"}


def _flat(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _flat(x)
        else:
            yield x


def _to_host(args, kwargs) -> bool:
    """Whether a `Tensor.to(...)` call names the host as its device."""
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a).type == "cpu"
        if isinstance(a, torch.Tensor):
            return not isinstance(a, OnDevice)
    return False


class OnDevice(torch.Tensor):
    """CPU data standing in for a tensor on a GPU (see the module docstring)."""

    reads: Counter = Counter()

    @property
    def device(self) -> torch.device:
        return torch.device("meta")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (_T.numpy, _T.__array__):
            raise TypeError("can't convert a device tensor to numpy: copy it to the host first")
        if func in _READS:
            cls.reads[_READS[func]] += 1
        elif func is _T.cpu or (func is _T.to and _to_host(args, kwargs)):
            cls.reads["copy"] += 1
            with torch._C.DisableTorchFunctionSubclass():
                plain = args[0].as_subclass(torch.Tensor)
                return (plain.to(*args[1:], **kwargs) if func is _T.to else plain).clone()
        elif func is not _T.__getitem__:  # a device tensor indexed by host indices is fine, as on CUDA
            tensors = [a for a in _flat([*args, *kwargs.values()]) if isinstance(a, torch.Tensor)]
            if any(isinstance(a, OnDevice) for a in tensors) and any(
                    not isinstance(a, OnDevice) and a.dim() > 0 for a in tensors):
                raise RuntimeError(f"{getattr(func, '__name__', func)}: expected all tensors to be on the same "
                                   "device, found a device tensor and a host tensor")
        return super().__torch_function__(func, types, args, kwargs)


def on_device(model):
    """The model's forward outputs (logits, hidden) as `OnDevice` tensors: the draft worker sees a GPU draft's."""
    forward = model.forward

    def wrapped(*a, **k):
        logits, hidden = forward(*a, **k)
        return logits.as_subclass(OnDevice), hidden.as_subclass(OnDevice)

    model.forward = wrapped
    return model


@pytest.fixture
def reads():
    OnDevice.reads = Counter()
    return OnDevice.reads


def _pair():
    target = build_tiny_model(vocab_size=32, hidden_size=32, seed=0, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, hidden_size=32, seed=0, num_layers=1, logit_scale=2.0)
    return target, draft


def _prompts():
    return [torch.randint(0, 32, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]


def test_the_stand_in_behaves_as_a_device_tensor(reads):
    x = torch.arange(4.0).as_subclass(OnDevice)
    assert x.device.type != "cpu" and isinstance(x * 2, OnDevice)
    with pytest.raises(TypeError):
        x.numpy()
    with pytest.raises(TypeError):
        np.asarray(x)
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(4)
    assert float(x[1]) == 1.0 and x.tolist() == [0.0, 1.0, 2.0, 3.0]
    host = x.cpu()
    assert type(host) is torch.Tensor and host.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert type(x.to("cpu", torch.float64)) is torch.Tensor and isinstance(x.to(torch.float64), OnDevice)
    assert reads == Counter(float=1, tolist=1, copy=2)


@pytest.mark.parametrize("block_size,threshold,head,lite", [(1, 0.5, False, False), (2, 0.3, True, False),
                                                            (3, 0.9, False, False), (1, 0.6, False, True)])
def test_greedy_pacer_on_a_device_draft_equals_ar_with_one_host_copy_per_block(block_size, threshold, head, lite,
                                                                                reads, monkeypatch):
    """The draft's outputs on a (stand-in) device: `pacer` and `pacer_pearl` run and equal `ar`; per drafted token
    the only host read is the greedy argmax (`int`), and each scored block brings its features over in one copy."""
    target, draft = _pair()
    pv = build_random_preverifier(32, seed=7, block_size=block_size, threshold=threshold,
                                  draft_model=draft if head else None, use_hidden=not lite, use_margin=lite)
    on_device(draft)
    scored = Counter()
    should_stop = PreverifierStop.should_stop

    def counted(self, features):
        scored["block"] += 1
        return should_stop(self, features)

    monkeypatch.setattr(PreverifierStop, "should_stop", counted)
    eng = Engine(target, draft, preverifier=pv, max_sessions=2, max_context=128, inline=True)
    try:
        for prompt in _prompts():
            ar = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode="ar"))
            for mode in ("pacer", "pacer_pearl"):
                reads.clear()
                scored.clear()
                out = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode=mode, gamma=8,
                                                     block_size=block_size, pearl_overlap="always"))
                assert out.token_ids == ar.token_ids, mode
                assert scored["block"] > 0
                assert set(reads) <= {"int", "copy"}, reads  # no float() / .item() / .tolist() per token
                assert reads["copy"] == scored["block"], (reads, scored)
                assert reads["int"] <= out.stats.draft_tokens + out.stats.rounds, reads  # the argmax per token
    finally:
        eng.close()


@pytest.mark.parametrize("lite", [False, True])
def test_sampled_pacer_on_a_device_draft_draws_what_a_host_draft_draws(lite, reads):
    """T = 1, seeded: a device draft (its rows copied to the host to sample, as a GPU draft's are) drafts and
    stops exactly as the same draft on the host does, so the outputs are equal (PEARL rounds throughout: adaptive
    overlap would choose rounds by measured speed)."""
    outs = []
    for device in (False, True):
        target, draft = _pair()
        pv = build_random_preverifier(32, seed=7, block_size=1, threshold=0.5, use_hidden=not lite,
                                      use_margin=lite)
        if device:
            on_device(draft)
        eng = Engine(target, draft, preverifier=pv, max_sessions=2, max_context=128, inline=True)
        try:
            outs.append([eng.generate(GenerationRequest(p, max_new_tokens=16, mode=mode, gamma=6,
                                                        params=SamplingParams(temperature=1.0, seed=3),
                                                        pearl_overlap="always"))
                         for p in _prompts() for mode in ("pacer", "pacer_pearl")])
        finally:
            eng.close()
    assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]]
    assert [r.stats.draft_tokens for r in outs[0]] == [r.stats.draft_tokens for r in outs[1]]
    assert reads["copy"] > 0 and not {"float", "item", "tolist"} & set(reads), reads


@pytest.mark.parametrize("head,lite", [(False, False), (True, False), (False, True)])
def test_preverifier_scores_features_given_on_a_device(head, lite, reads):
    """Features a caller hands over on a device are scored as on the host (`DraftFeatures.on_host`, one copy of
    each tensor): the round scorer and `block_accept_prob`."""
    draft = build_tiny_model(hidden_size=32, seed=3) if head else None
    pv = build_random_preverifier(32, seed=5, draft_model=draft, use_hidden=not lite, use_margin=lite)
    g = torch.Generator().manual_seed(0)
    n = 6
    host = DraftFeatures(hidden=torch.randn(n, 32, generator=g), tokens=torch.randint(0, 32, (n,), generator=g),
                         logq=-torch.rand(n, generator=g), entropy=torch.rand(n, generator=g), block_start=4,
                         margin=torch.rand(n, generator=g) * 3)
    dev = DraftFeatures(**{k: v.as_subclass(OnDevice) if isinstance(v, torch.Tensor) else v
                           for k, v in vars(host).items()})
    assert pv.round_scorer().score(dev) == pytest.approx(pv.round_scorer().score(host), rel=1e-6)
    assert pv.block_accept_prob(dev) == pytest.approx(pv.block_accept_prob(host), rel=1e-6)
    assert reads["copy"] > 0 and not {"float", "item", "tolist"} & set(reads), reads


# ---------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("head,lite", [(False, False), (True, False), (False, True)])
def test_cuda_pacer_and_pacer_pearl_equal_ar(head, lite):
    """Both models on the GPU (fp32 tiny pair, the workers' CUDA graphs on): greedy `pacer` and `pacer_pearl`, with
    the pre-verifier on the host, equal `ar`."""
    target, draft = (m.to("cuda") for m in _pair())
    pv = build_random_preverifier(32, seed=7, block_size=2, threshold=0.3, draft_model=draft if head else None,
                                  use_hidden=not lite, use_margin=lite)
    eng = Engine(target, draft, preverifier=pv, max_sessions=2, max_context=128, inline=True)
    try:
        drafted = 0
        for prompt in _prompts():
            ar = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode="ar"))
            for mode in ("pacer", "pacer_pearl"):
                out = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode=mode, gamma=8, block_size=2,
                                                     pearl_overlap="always"))
                assert out.token_ids == ar.token_ids, mode
                drafted += out.stats.draft_tokens
        assert drafted > 0
    finally:
        eng.close()
