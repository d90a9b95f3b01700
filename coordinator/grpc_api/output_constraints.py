"""What a request asks of its output beyond sampling, read with the coordinator's tokenizer: bad words as token
sequences, structured output as an llguidance grammar (after the reasoning, where there is one), and where a
reasoning model's answer starts (coordinator/grpc_api/reasoning.py). The servicer holds one `OutputConstraints`.
Pure: no grpc."""
from __future__ import annotations

from coordinator.grpc_api.reasoning import ReasoningStart, ThinkTags, answer_start, gate_grammar
from specdec.common.errors import InvalidRequestError
from specdec_rpc.pb import common_pb2, generation_pb2


class OutputConstraints:
    def __init__(self, tokenizer=None, eos: tuple[int, ...] = (), reasoning_parser: str = ""):
        self.tok, self.eos = tokenizer, eos
        # separate_reasoning's parser (COORDINATOR_REASONING_PARSER; "": the request is refused)
        self.reasoning_parser = reasoning_parser
        self.tags: ThinkTags | None = None  # the tokenizer's <think> / </think> ids, read on first use
        self._vocab = None  # structured output's GrammarVocab of this tokenizer, built on first use (False: none)

    def derive(self, r: generation_pb2.GenerateRequest, ids: list[int],
               sampling: common_pb2.SamplingParams) -> ReasoningStart | None:
        """What the request's output constraints come to, read once: where a reasoning model's answer starts
        (returned; None: no separate reasoning), and, written into the request's SamplingParams message for the
        replicas, its structured output's grammar and its bad words as token sequences."""
        reasoning = self.reasoning_start(r, ids)
        sampling.grammar = self.grammar(r, reasoning)
        sampling.bad_words.extend(common_pb2.TokenIds(ids=w) for w in self.bad_words(r))
        return reasoning

    def reasoning_start(self, r: generation_pb2.GenerateRequest, ids: list[int]) -> ReasoningStart | None:
        if not r.separate_reasoning:
            return None
        if not self.reasoning_parser or self.tok is None:
            raise InvalidRequestError("separate_reasoning", "this coordinator has no reasoning parser: start it "
                                                            "with COORDINATOR_REASONING_PARSER (deepseek_r1, qwen3) "
                                                            "or leave separate_reasoning unset")
        if self.tags is None:
            self.tags = ThinkTags.of(self.tok)
        return answer_start(self.reasoning_parser, ids,
                            lambda t: self.tok.decode(t, skip_special_tokens=False))

    def bad_words(self, r: generation_pb2.GenerateRequest) -> list[list[int]]:
        """vLLM's bad_words → token sequences: each word tokenized as is and after a space (as vLLM does)."""
        if not r.bad_words:
            return []
        if self.tok is None:
            raise InvalidRequestError("bad_words", "this coordinator has no tokenizer to tokenize them")
        seqs = {tuple(self.tok.encode(text, add_special_tokens=False)) for w in r.bad_words for text in (w, " " + w)}
        return sorted(list(s) for s in seqs if s)

    def grammar(self, r: generation_pb2.GenerateRequest, reasoning: ReasoningStart | None) -> str:
        """The llguidance grammar of r.structured_output ("" if unset), after the reasoning where there is one;
        `check_grammar` checks it against the tokenizer."""
        if not r.HasField("structured_output"):
            return ""
        from specdec_rpc.decode import structured_from_proto

        form = structured_from_proto(r.structured_output)
        if r.ignore_eos:
            raise InvalidRequestError("ignore_eos", "structured output ends with the model's EOS token; leave "
                                                    "ignore_eos unset")
        if not self.eos:
            raise InvalidRequestError("structured_output", "this model names no EOS token, which ends a structured "
                                                           "output")
        grammar = form.grammar()
        return gate_grammar(grammar, reasoning, self.tags, self.eos) if reasoning is not None else grammar

    def check_grammar(self, grammar: str) -> None:
        """Compile the grammar against this tokenizer (INVALID_ARGUMENT saying why it does not); the caller runs it
        off the event loop: a large schema can take 100 ms or more, once (GrammarVocab caches compiled grammars)."""
        if self._vocab is None and self.tok is not None:
            from specdec.text.grammar import GrammarVocab

            try:
                self._vocab = GrammarVocab(self.tok.backend_tokenizer.to_str(), len(self.tok), self.eos)
            except Exception:  # noqa: BLE001 - the replicas check the grammar too
                self._vocab = False
        if self._vocab:
            self._vocab.check(grammar)
