"""The coordinator's CPU-heavy request work, off the serving event loop: tokenizing prompts, rendering chat
templates, compiling grammars, decoding long texts. On the loop, one 1 MiB prompt (seconds to tokenize) stalled
every stream the coordinator serves; here it runs in a small thread pool (`PROMPT_WORKERS` threads: a bound on
the cores it takes from the streams, the rest wait in its queue), and the loop serves the streams meanwhile.

`least_prompt_tokens` is the cheap check before any of it: no tokenizer turns fewer than `b / L` tokens out of
`b` bytes of text, where `L` is its longest token's byte length, so a prompt whose floor is over the context is
refused (OUT_OF_RANGE) without tokenizing it.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from specdec_rpc.pb import generation_pb2

T = TypeVar("T")
PROMPT_WORKERS = 2


class PromptWork:
    """A bounded thread pool for a coordinator's prompt work (`run`), shared by its gRPC and HTTP doors."""

    def __init__(self, workers: int = PROMPT_WORKERS):
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args, **kw) -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="prompt-work")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kw))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def longest_token_bytes(tok) -> int:
    """An upper bound of the bytes one token of `tok` covers: its longest vocabulary entry's UTF-8 length (a
    byte-level entry's characters stand for one byte each, and take one to three in UTF-8; a byte-fallback entry,
    "<0xE2>", takes six for one), at least 1. 0: unknown (no vocabulary to read)."""
    try:
        vocab = tok.get_vocab()
    except Exception:  # noqa: BLE001 - no bound, no check
        return 0
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=0)


def prompt_bytes(r: generation_pb2.GenerateRequest) -> int:
    """The UTF-8 bytes of a request's text that every encoding keeps: the prompt, or the users' messages (a chat
    template may leave out other turns' text, e.g. earlier reasoning)."""
    if r.HasField("prompt"):
        return len(r.prompt.encode("utf-8"))
    return sum(len(m.content.encode("utf-8")) for m in r.messages if m.role == "user")


def least_prompt_tokens(r: generation_pb2.GenerateRequest, longest: int) -> int:
    """The fewest tokens the request's text could encode to (0: unknown)."""
    if longest <= 0:
        return 0
    return -(-prompt_bytes(r) // longest)
