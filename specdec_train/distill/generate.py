"""Step 1: target continuations on a diverse prompt set (chat, code, math, prose; greedy and sampled).

Prompts are built from the templates x topics below (none is a benchmark prompt: HumanEval and the repository's
chat benchmark set are never used for training). Rows: {"prompt_ids", "completion_ids", "temperature"}; the
temperature cycles greedy / 0.7 / 1.0 per batch (no top-k/top-p truncation). Appends to ``out`` and flushes per
batch, so an interrupted run keeps what it made; reruns with another seed add new prompts.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec_train.distill.code_prompts import chat_code_prompts, code_prompts, humaneval_entry_points

TOPICS = [
    # code
    "recursion", "dynamic programming", "regular expressions", "HTTP caching", "Python decorators",
    "list comprehensions", "Git branching", "Docker volumes", "JSON parsing", "REST API design", "quicksort",
    "binary search", "hash maps", "linked lists", "graph traversal", "Dijkstra's algorithm", "tries",
    "bit manipulation", "string reversal", "palindromes", "reading a CSV file in Python", "async IO in Python",
    "Python type hints", "context managers", "generators in Python", "JavaScript promises", "CSS grid",
    "SQL joins", "database transactions", "Linux file permissions", "shell scripting", "the Rust borrow checker",
    "Go goroutines", "C pointers", "memory leaks", "unit testing", "logging best practices", "sorting a dictionary",
    # math / science
    "matrix multiplication", "gradient descent", "overfitting", "the Pythagorean theorem", "prime numbers",
    "compound interest", "probability of coin flips", "fractions", "percentages", "the area of a circle",
    "linear equations", "the speed of sound", "black holes", "plate tectonics", "the immune system",
    "photosynthesis", "DNA", "the water cycle", "electric circuits", "Newton's laws", "the periodic table",
    # prose / everyday
    "the Silk Road", "the printing press", "ancient Rome", "the Renaissance", "jazz music", "learning the piano",
    "marathon training", "baking bread", "composting", "houseplants", "budgeting", "writing a cover letter",
    "public speaking", "time management", "electric cars", "solar energy", "recycling", "chess", "origami",
    "birdwatching", "astronomy", "volcanoes", "ocean tides", "healthy eating", "sleep", "meditation",
    "inflation", "supply and demand", "negotiation", "email etiquette", "a lighthouse keeper", "a lost robot",
    "a talking tree", "a winter morning", "a city at night", "friendship", "a journey by train",
    # second batch (more prompt variety for later generations; none is a benchmark prompt)
    "merge sort", "heaps and priority queues", "binary trees", "stacks and queues", "big-O notation",
    "Python dataclasses", "exceptions in Python", "virtual environments", "unicode strings", "file I/O",
    "multithreading", "TCP vs UDP", "DNS", "public-key cryptography", "password hashing", "caching strategies",
    "load balancing", "message queues", "NumPy arrays", "pandas DataFrames", "matplotlib plots", "web scraping",
    "the command line", "Makefiles", "YAML files", "environment variables", "code reviews", "refactoring",
    "derivatives", "integrals", "statistics and the mean", "standard deviation", "vectors", "logarithms",
    "the Fibonacci sequence", "geometry of triangles", "unit conversions", "simple interest", "magnets",
    "the solar system", "the human heart", "climate change", "rainforests", "bees and pollination", "earthquakes",
    "the French Revolution", "the invention of the telephone", "the Olympic Games", "coffee", "tea ceremonies",
    "gardening tomatoes", "camping", "cycling", "swimming", "painting with watercolors", "photography",
    "learning a new language", "job interviews", "saving for retirement", "remote work", "a dragon who cannot fly",
    "an old bookshop", "a robot chef", "a rainy afternoon", "the first day of school", "a mountain village",
]
TEMPLATES = [
    "Explain {} in simple terms.", "Write a short paragraph about {}.", "Give three key facts about {}.",
    "What are common mistakes people make with {}?", "Write a Python function related to {}, with a docstring.",
    "Summarize {} in five bullet points.", "Write a short story about {}.", "Teach me {} step by step.",
    "Compare two approaches to {}.", "Answer briefly: why does {} matter?", "Write a code example that uses {}.",
    "Give me a quiz question about {} and its answer.", "Write a haiku about {}.",
    "Solve a simple math word problem involving {} and show your work.", "What is the history of {}?",
    "Write a dialogue between a teacher and a student about {}.", "List pros and cons of {}.",
    "Explain {} to a ten-year-old.", "Write a limerick about {}.", "What is a fun fact about {}?",
    "Describe {} in one paragraph, then give an example.", "Write a blog post introduction about {}.",
    "How would you explain {} in an interview?", "Write a tweet about {}.", "Give a step-by-step guide to {}.",
]


def make_prompts(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(TEMPLATES).format(rng.choice(TOPICS)) for _ in range(n)]


@torch.no_grad()
def fresh_prompts(rng: random.Random, n: int, encode, exclude: set, tries: int = 200) -> list[str]:
    """Up to n prompts whose token ids are not in `exclude` (nor repeated); `exclude` grows with the ones taken."""
    out = []
    for _ in range(n * tries):
        if len(out) == n:
            break
        p = rng.choice(TEMPLATES).format(rng.choice(TOPICS))
        ids = tuple(encode(p))
        if ids not in exclude:
            exclude.add(ids)
            out.append(p)
    return out


def chat_text(tok, user: str) -> str:
    """One user turn through the chat template, with the generation prompt (text, not ids)."""
    return tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)


def self_instruct(model, tok, n: int, temperature: float = 1.0, max_tokens: int = 64, min_chars: int = 12) -> list[str]:
    """Up to n user messages sampled from the target after the chat template's user header, each ended by the
    tokenizer's EOS (the turn's end for chat models); short or unfinished ones are dropped."""
    marker = "\x00"
    header = chat_text(tok, marker).split(marker)[0]
    if not header:
        raise ValueError("the chat template writes nothing before a user's message, so the target cannot be asked "
                         "for one: generate with another style (chat: templates x topics)")
    dev = next(model.parameters()).device
    enc = tok([header] * n, return_tensors="pt").to(dev)
    end = tok.eos_token_id  # SmolLM2: <|im_end|>, which also closes a user turn
    g = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                       max_new_tokens=max_tokens, eos_token_id=end, pad_token_id=tok.pad_token_id).cpu()
    out = []
    for row in g[:, enc["input_ids"].shape[1]:].tolist():
        if end not in row:
            continue
        text = tok.decode(row[:row.index(end)], skip_special_tokens=True).strip()
        if len(text) >= min_chars:
            out.append(text)
    return out


@torch.no_grad()
def complete(model, tok, texts: list[str], temperature: float, max_new_tokens: int) -> list[dict]:
    """Target continuations of `texts` (already chat-templated where wanted), batched with left padding; each row
    is cut after the first EOS. -> [{"prompt_ids", "completion_ids", "temperature"}]."""
    dev = next(model.parameters()).device
    enc = tok(texts, return_tensors="pt", padding=True).to(dev)
    kw = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_p=1.0,
                                                              top_k=0)
    g = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **kw).cpu()
    plen = enc["input_ids"].shape[1]
    rows = []
    for row, mask in zip(g, enc["attention_mask"].cpu()):
        prompt_ids = row[:plen][mask.bool()].tolist()
        comp = row[plen:].tolist()
        while comp and comp[-1] == tok.pad_token_id and tok.pad_token_id != tok.eos_token_id:
            comp.pop()
        if tok.eos_token_id in comp:
            comp = comp[:comp.index(tok.eos_token_id) + 1]
        rows.append({"prompt_ids": prompt_ids, "completion_ids": comp, "temperature": temperature})
    return rows


def generate(model_dir, out_path, seconds: float = 600, seed: int = 0, batch_size: int = 16,
             max_new_tokens: int = 192, progress: bool = True, dtype: str = "auto",
             exclude_prompt_ids: set | None = None, temperatures: tuple[float, ...] = (0.0, 0.7, 1.0),
             style: str = "chat") -> int:
    """`exclude_prompt_ids`: chat-templated prompt ids to avoid (e.g. everything a draft trained on, so that a
    pre-verifier sees the draft on text it has not memorised); then no prompt repeats within the run either.
    `style`: "chat" (templates x topics, chat-templated), "self" (user turns sampled from the target itself,
    `self_instruct`: an open-ended supply of new prompts), "code" (raw Python stubs, `code_prompts.py`) or
    "chatcode" (the same stubs asked for in a chat turn, chat-templated)."""
    from specdec.modeling.dtypes import resolve_dtype  # here: the core's settings need pydantic, which `gpu_run` avoids

    rng = random.Random(seed)
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"

    # the served dtype (`auto`: bf16 on CPUs with native bf16 GEMMs, where batched decoding is also much faster)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=resolve_dtype(dtype, "cpu", "target")).eval()
    t0, n_tok, batch_i = time.time(), 0, 0
    encode_chat = lambda p: tok(chat_text(tok, p))["input_ids"]  # noqa: E731 - the ids `complete` stores
    if style in ("code", "chatcode"):
        banned, used = humaneval_entry_points(), set()
    bar = tqdm(desc="generate", unit="tok", disable=not progress)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a") as out:
        while time.time() - t0 < seconds:
            temp = temperatures[batch_i % len(temperatures)]
            batch_i += 1
            if style == "code":
                prompts = code_prompts(rng, batch_size, banned)
            elif style == "chatcode":  # ~2,000 distinct turns: no repeats within a run
                prompts = list(dict.fromkeys(p for p in chat_code_prompts(rng, batch_size, banned) if p not in used
                                             and tuple(encode_chat(p)) not in (exclude_prompt_ids or ())))
                used.update(prompts)
                if not prompts:
                    break
            elif style == "self":
                prompts = [p for p in self_instruct(model, tok, batch_size)
                           if tuple(encode_chat(p)) not in (exclude_prompt_ids or ())]
            elif exclude_prompt_ids is None:
                prompts = make_prompts(rng, batch_size)
            else:
                prompts = fresh_prompts(rng, batch_size, encode_chat, exclude_prompt_ids)
                if not prompts:
                    break  # every template x topic combination is excluded or taken
            texts = prompts if style == "code" else [chat_text(tok, p) for p in prompts]
            for row in complete(model, tok, texts, temp, max_new_tokens):
                out.write(json.dumps(row) + "\n")
                n_tok += len(row["completion_ids"])
                bar.update(len(row["completion_ids"]))
            out.flush()
    return n_tok
