"""Streaming detokenization (specdec/text/tokenizer.py `IncrementalDetokenizer`) on tokenizers built here, with
multi-byte characters (CJK, emoji) split over several byte tokens and special tokens, skipped or not:

- the pieces pushed one token or a few at a time, then flushed, concatenate to `tok.decode(ids)`: any ids for a
  byte-level BPE (whose decoding of invalid UTF-8 is prefix-stable); the encodings of random texts, with special
  tokens between them, for a byte-fallback BPE whose decoder strips the first leading space (Llama 2's);
- a fast tokenizer (tokenizers' `DecodeStream`) and a slow one (`tok.decode` of the same windows) give the same
  pieces at the same pushes for any ids, prompt context included, so that stop strings (coordinator/grpc_api/
  text_output.py) end the text at the same token either way;
- the prompt's last tokens are context: the first generated text is as it reads after the prompt.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from coordinator.grpc_api.text_output import TextAssembler
from specdec.text.tokenizer import IncrementalDetokenizer, _stream_backend

QUICK = settings(deadline=None, database=None, derandomize=True, max_examples=300,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]
CHARS = list("abcdehlorw .,!") + ["é", "ö", "日", "本", "語", "中", "🙂", "🚀", "😀", "👍🏽"]


def byte_level_bpe():
    """GPT-2 style: bytes mapped to printable characters; few merges, so most multi-byte characters are split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello world", "héllo wörld", "日本語のテキスト", "emoji 🙂 and 🚀 rockets", "plain ascii text"] * 5
    t.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_end|>"])


def byte_fallback_bpe():
    """Llama 2 style: ▁ for spaces, characters outside the vocabulary as <0xNN> byte tokens, and a decoder that
    strips the text's first leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS, limit_alphabet=40,
                                  initial_alphabet=list("▁abcdefghijklmnopqrstuvwxyz.,!?"))
    t.train_from_iterator(["hello▁world", "the▁quick▁brown▁fox,▁jumps!", "over▁the▁lazy▁dog"] * 5, trainer)
    spec = json.loads(t.to_str())
    n = len(SPECIALS)
    vocab = {k: v if v < n else v + 256 for k, v in spec["model"]["vocab"].items()}
    vocab.update({f"<0x{b:02X}>": n + b for b in range(256)})
    spec["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True)
    t = Tokenizer.from_str(json.dumps(spec))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_end|>"])


BYTE_LEVEL, BYTE_FALLBACK = byte_level_bpe(), byte_fallback_bpe()
TOKENIZERS = {"byte_level": BYTE_LEVEL, "byte_fallback": BYTE_FALLBACK}


class Slow:
    """The same tokenizer seen as a slow (Python) one: a `decode` and no `backend_tokenizer`."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def pieces(tok, ids, chunks, skip, prefix=()):
    """Every push's text (pushing `chunks` tokens at a time, cycled; a chunk of 1 as an int) and the flush's."""
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip, prefix_ids=prefix)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        out.append(det.push(ids[i] if n == 1 else ids[i:i + n]))
        i, k = i + n, k + 1
    return out + [det.flush()]


chunk_sizes = st.lists(st.integers(1, 4), min_size=1, max_size=6)


def test_fast_tokenizers_step_a_decode_stream_and_others_decode_windows():
    from tokenizers import Tokenizer

    assert all(_stream_backend(tok) is tok.backend_tokenizer for tok in TOKENIZERS.values())
    assert IncrementalDetokenizer(BYTE_LEVEL)._stream is not None
    assert _stream_backend(Slow(BYTE_LEVEL)) is None and IncrementalDetokenizer(Slow(BYTE_LEVEL))._stream is None
    raw = Tokenizer.from_str(BYTE_LEVEL.backend_tokenizer.to_str())
    assert _stream_backend(raw) is raw


@QUICK
@given(ids=st.lists(st.integers(0, len(BYTE_LEVEL) - 1), max_size=40), chunks=chunk_sizes, skip=st.booleans())
def test_byte_level_any_ids_stream_to_their_decoding(ids, chunks, skip):
    got = pieces(BYTE_LEVEL, ids, chunks, skip)
    assert "".join(got) == BYTE_LEVEL.decode(ids, skip_special_tokens=skip)
    assert not any(p.endswith("\ufffd") for p in got[:-1])  # a broken character waits for its other bytes


@QUICK
@given(parts=st.lists(st.tuples(st.lists(st.sampled_from(CHARS), max_size=12).map("".join),
                                st.sampled_from([None] + SPECIALS)), min_size=1, max_size=5),
       chunks=chunk_sizes, skip=st.booleans(), name=st.sampled_from(sorted(TOKENIZERS)))
def test_texts_with_special_tokens_between_them_stream_to_their_decoding(parts, chunks, skip, name):
    tok = TOKENIZERS[name]
    ids = []
    for text, special in parts:
        ids += tok(text, add_special_tokens=False)["input_ids"]
        if special is not None:
            ids.append(tok.convert_tokens_to_ids(special))
    got = pieces(tok, ids, chunks, skip)
    assert "".join(got) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in got)


@QUICK
@given(data=st.data(), chunks=chunk_sizes, skip=st.booleans(), name=st.sampled_from(sorted(TOKENIZERS)))
def test_the_stream_and_the_decoded_windows_give_the_same_pieces(data, chunks, skip, name):
    """Any ids, invalid UTF-8 and prompts that end mid-character included."""
    tok = TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=40))
    prefix = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=10))
    assert pieces(tok, ids, chunks, skip, prefix) == pieces(Slow(tok), ids, chunks, skip, prefix)


@QUICK
@given(ids=st.lists(st.integers(0, len(BYTE_FALLBACK) - 1), max_size=40), chunks=chunk_sizes,
       stop=st.lists(st.sampled_from(["lo w", "日本", "🚀", "o", "\ufffd"]), max_size=2), include=st.booleans(),
       stop_ids=st.sets(st.integers(0, len(SPECIALS) - 1), max_size=2))
def test_stop_strings_end_the_text_at_the_same_token_either_way(ids, chunks, stop, include, stop_ids):
    def assemble(tok):
        asm = TextAssembler(tok, [7, 8], stop, stop_token_ids=stop_ids, include_stop=include)
        out, i, k = [], 0, 0
        while i < len(ids):
            n = chunks[k % len(chunks)]
            out.append(asm.push(ids[i:i + n]))
            i, k = i + n, k + 1
        return out, asm.finish(), asm.stop_reason, asm.token_ids

    assert assemble(BYTE_FALLBACK) == assemble(Slow(BYTE_FALLBACK))


def test_a_context_that_rewrites_the_text_returned_holds_it_back():
    """é's two bytes, then a third continuation byte: the byte-fallback decoder turns the three into U+FFFDs, so the
    window's text no longer starts with the é returned; it is held (DecodeStream raises), as the slow path does."""
    tok = BYTE_FALLBACK
    byte = tok.convert_tokens_to_ids
    ids = [byte("<0xC3>"), byte("<0xA9>"), byte("<0xA9>")] + tok("ab", add_special_tokens=False)["input_ids"]
    from tokenizers.decoders import DecodeStream

    got = pieces(tok, ids, [1], True)
    assert got == pieces(Slow(tok), ids, [1], True)
    assert got[:2] == ["", "é"] and not any(got[2:-1]) and got[-1].endswith("ab")
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for i in ids:
            stream.step(tok.backend_tokenizer, i)


def test_the_prompts_last_tokens_are_context():
    """The decoder strips the first leading space: generated " world" after the prompt "hello" streams with it,
    as the whole text decodes."""
    tok = BYTE_FALLBACK
    full = tok("hello big world", add_special_tokens=False)["input_ids"]
    for k in range(1, len(full)):
        prompt, gen = full[:k], full[k:]
        text = "".join(pieces(tok, gen, [1], True, prompt))
        assert tok.decode(prompt) + text == tok.decode(full), k
    k = full.index(tok.convert_tokens_to_ids("▁"), 1)  # a lone ▁ token starts the generated part
    assert "".join(pieces(tok, full[k:], [1], True, full[:k])).startswith(" ")
    assert not tok.decode(full[k:]).startswith(" ")


@pytest.mark.parametrize("model,fast", [("BPE", True), ("WordLevel", False)])
def test_a_tokenizer_that_cleans_up_spaces_decodes_as_transformers_does(model, fast):
    """transformers cleans up tokenization spaces (" ," -> ",") for any model but BPE: such a tokenizer's windows
    are decoded by `tok.decode`; a BPE one with the flag set streams, and matches `tok.decode`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if model == "BPE":
        t = Tokenizer.from_str(BYTE_LEVEL.backend_tokenizer.to_str())
    else:
        words = ["<unk>", "hello", "world", ",", "."]
        t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        t.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", clean_up_tokenization_spaces=True)
    assert (_stream_backend(tok) is not None) == fast
    ids = tok("hello , world .", add_special_tokens=False)["input_ids"]
    assert "".join(pieces(tok, ids, [1], True)) == tok.decode(ids, skip_special_tokens=True)
