"""The OpenAI-compatible API's response bodies (plain dicts: what the OpenAI API returns, plus `stats`, specdec's
per-request statistics: each choice carries its own, and the top level repeats choice 0's). Pure: the generated
proto, no web framework.
"""
from __future__ import annotations

from google.protobuf.json_format import MessageToDict

from coordinator.http_api.structured import ToolChoice
from specdec_rpc.pb import generation_pb2

FINISH_REASON = {generation_pb2.FINISH_REASON_LENGTH: "length", generation_pb2.FINISH_REASON_STOP: "stop",
                 generation_pb2.FINISH_REASON_CANCELLED: "abort"}


def stop_reason(resp) -> str | int | None:
    """vLLM's stop_reason of a final response: the stop string or stop token id that ended it (None: EOS, length)."""
    which = resp.WhichOneof("stop_reason")
    return getattr(resp, which) if which is not None else None


def token_id_text(token_id: int) -> str:
    """A logprobs entry's token with vLLM's return_tokens_as_token_ids: unambiguous where text is not."""
    return f"token_id:{token_id}"


def usage(stats: list[generation_pb2.GenerationStats], n: int = 1, reasoning: bool = False) -> dict:
    """OpenAI's usage over every choice, `n` per prompt (each prompt's tokens counted once);
    `prompt_tokens_details.cached_tokens`: per prompt, the positions every one of its choices' target sessions reused
    from the prefix cache (OpenAI's and vLLM's name for them), summed; `reasoning`: with
    `completion_tokens_details.reasoning_tokens`."""
    groups = [stats[k:k + n] for k in range(0, len(stats), n)]
    prompt, completion = sum(g[0].prompt_tokens for g in groups), sum(s.completion_tokens for s in stats)
    cached = sum(min(s.cached_prompt_tokens for s in g) for g in groups)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(s.reasoning_tokens for s in stats)}
    return out


def stats_dict(stats: generation_pb2.GenerationStats) -> dict:
    return MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def logprobs_body(chat: bool, token_ids, logprobs: generation_pb2.GeneratedLogprobs | None, token_text,
                  offset: int = 0) -> dict | None:
    """OpenAI's logprobs object for these tokens (chat: `content` entries; completions: parallel lists, with
    `text_offset` counted from `offset`, a stream's characters so far). `token_text(id)` is a token's text."""
    if logprobs is None:
        return None
    tokens = [token_text(t) for t in token_ids]
    tops = [[(token_text(i), v) for i, v in zip(top.ids, top.logprobs)] for top in logprobs.top]
    if chat:
        def entry(text, lp):
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(text, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                            for text, lp, top in zip(tokens, logprobs.logprobs, tops)]}
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": list(logprobs.logprobs), "top_logprobs": [dict(top) for top in tops],
            "text_offset": offsets}


def echo_logprobs_body(prompt_ids: list[int], prompt_lps: generation_pb2.GeneratedLogprobs | None, ids: list[int],
                       lps: generation_pb2.GeneratedLogprobs | None, token_text) -> dict | None:
    """Completions' logprobs with echo: the prompt's tokens first (the first has none, as in OpenAI's API)."""
    if lps is None:
        return None
    merged = generation_pb2.GeneratedLogprobs()
    merged.MergeFrom(prompt_lps or generation_pb2.GeneratedLogprobs())
    merged.MergeFrom(lps)
    body = logprobs_body(False, prompt_ids[1:] + ids, merged, token_text)
    body["tokens"].insert(0, token_text(prompt_ids[0]))
    body["token_logprobs"].insert(0, None)
    body["top_logprobs"].insert(0, None)
    body["text_offset"] = [0] + [o + len(body["tokens"][0]) for o in body["text_offset"]]
    return body


def completion_body(chat: bool, rid: str, created: int, model: str, answers: list[tuple],
                    tool: ToolChoice | None = None, n: int = 1) -> dict:
    """`answers`: (text, finish_reason, stats, logprobs object or None, stop_reason, reasoning) per choice, in
    index order; reasoning None: not separated, "": left out (include_reasoning: false). `tool`: a forced tool
    choice, whose answers come back as the message's tool_calls."""
    choices = []
    for i, (text, finish, stats, logprobs, reason, reasoning) in enumerate(answers):
        if tool is not None:
            message, finish = tool.message(text, finish)
            choice = {"index": i, "message": message}
        else:
            choice = {"index": i, "message": {"role": "assistant", "content": text}} if chat else {"index": i,
                                                                                                   "text": text}
        if reasoning is not None:
            choice["message"]["reasoning"] = reasoning or None
        choices.append({**choice, "logprobs": logprobs, "finish_reason": finish, "stop_reason": reason,
                        "stats": stats_dict(stats)})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices,
            "usage": usage([a[2] for a in answers], n, any(a[5] is not None for a in answers)),
            "stats": choices[0]["stats"]}


def chunk_body(chat: bool, rid: str, created: int, model: str, text: str | None, finish: str | None,
               role: bool = False, with_usage: bool = False, index: int = 0,
               stats: generation_pb2.GenerationStats | None = None, logprobs: dict | None = None,
               delta: dict | None = None, reason: str | int | None = None) -> dict:
    """One streamed chunk of choice `index`. Chat: `role` marks a choice's first chunk (its delta carries the
    role). A choice's last chunk carries its finish_reason, stop_reason and stats. Every chunk has `usage: null` when the client
    asked for usage (the last chunk, `usage_chunk`, carries it)."""
    if chat:
        if delta is None:  # `delta`: a chat chunk's own (tool calls)
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = reason
    if stats is not None:
        choice["stats"] = stats_dict(stats)
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}
    if with_usage:
        body["usage"] = None
    return body


def usage_chunk(chat: bool, rid: str, created: int, model: str,
                stats: list[generation_pb2.GenerationStats], n: int = 1, reasoning: bool = False) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(stats, n, reasoning), "stats": stats_dict(stats[0])}
