"""Structured output under speculation, measured: JSON-schema requests in each mode against `ar` with the same
schema (in process, default pair, greedy, one thread per model, prompt lookup as the draft replica's default).

    python scripts/structured_output_bench.py [--modes ar ar:free sd sd:noforced pacer pacer:noforced] [--repeats 2]

Each prompt asks for a JSON object and carries a schema (specdec/grammar.py). A mode may carry a flag: `:free`
runs it without the schema (what the grammar costs), `:noforced` without the draft's grammar-forced proposals,
`:nolookup` without prompt lookup. Per
mode: tokens/s (median over prompts and repeats), tokens per target forward, the share of drafted tokens proposed
without a draft forward (forced by the grammar or looked up), how many answers parse with the schema's required keys out of
those that ended (not cut by --max-new-tokens), and how many equal `ar`'s (greedy, same schema: all must). The
modes run round-robin per prompt, alternating the order.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {
    "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
    "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 3}, "summary": {"type": "string"}},
    "required": ["title", "author", "year", "genres", "summary"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "temperature_c": {"type": "number"},
    "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}, "wind_kph": {"type": "number"}},
    "required": ["city", "temperature_c", "conditions", "wind_kph"], "additionalProperties": False}
PROMPTS = [
    ("Describe a fictional person as JSON with name, age, city and hobbies.", PERSON),
    ("Invent a person who lives in Lisbon and loves music; answer in JSON.", PERSON),
    ("Give me a classic novel as JSON: title, author, year, genres and a one-sentence summary.", BOOK),
    ("Recommend a science fiction book, as JSON.", BOOK),
    ("Report today's weather in Paris as JSON.", WEATHER),
    ("What is the weather like in Oslo in winter? Answer as JSON.", WEATHER),
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["ar", "ar:free", "sd", "sd:noforced", "pacer", "pacer:noforced"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    args = ap.parse_args(argv)

    import torch

    from specdec_bench.default_pair import load_default_pair
    from specdec.engine import Engine
    from specdec.grammar import StructuredOutput
    from specdec.lookup import prompt_lookup
    from specdec.request import GenerationRequest
    from specdec.sampling import SamplingParams
    from specdec.tokenizer import encode_prompt, eos_token_ids, load_tokenizer

    torch.set_num_threads(1)
    target, draft, pv, tdir = load_default_pair()
    lookup = prompt_lookup(3)
    eng = Engine(target, draft, preverifier=pv, threads_per_model=1, prefix_cache=False, lookup=lookup)
    tok = load_tokenizer(tdir)
    eos = tuple(sorted(eos_token_ids(tdir)))
    reqs = [(encode_prompt(tok, messages=[{"role": "user", "content": p}]), schema,
             StructuredOutput("json_schema", json.dumps(schema)).grammar()) for p, schema in PROMPTS]
    rows = {m: {"tps": [], "tpf": [], "forced": [], "valid": 0, "ended": 0, "same": 0, "n": 0} for m in args.modes}
    ar_out: dict[int, list[int]] = {}
    for rep in range(args.repeats):
        for i, (ids, schema, grammar) in enumerate(reqs):
            order = args.modes if (rep + i) % 2 == 0 else args.modes[::-1]
            for name in order:
                mode, _, flag = name.partition(":")
                eng.draft_worker.grammar_forced = flag != "noforced"
                eng.draft_worker.lookup = None if flag == "nolookup" else lookup
                looked0 = eng.draft_worker.looked_up_tokens
                t0 = time.perf_counter()
                res = eng.generate(GenerationRequest(ids, args.max_new_tokens, mode=mode, eos_token_ids=eos,
                                                     params=SamplingParams(grammar="" if flag == "free" else grammar)))
                wall = time.perf_counter() - t0
                r = rows[name]
                r["n"] += 1
                r["tps"].append(len(res.token_ids) / wall)
                r["tpf"].append(len(res.token_ids) / max(res.stats.target_forwards, 1))
                r["forced"].append((eng.draft_worker.looked_up_tokens - looked0) / max(res.stats.draft_tokens, 1))
                if res.finish_reason == "stop":
                    r["ended"] += 1
                    try:
                        obj = json.loads(tok.decode(res.token_ids, skip_special_tokens=True))
                        r["valid"] += isinstance(obj, dict) and all(k in obj for k in schema["required"])
                    except ValueError:
                        pass
                if flag == "free":
                    continue
                if mode == "ar":
                    ar_out[i] = res.token_ids
                r["same"] += ar_out.get(i, res.token_ids) == res.token_ids
    base = statistics.median(rows["ar"]["tps"]) if "ar" in rows else None
    print("| mode | tokens/s | vs ar (same schema) | tokens per target forward | drafted without a forward | "
          "valid JSON / ended | equal to ar |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        tps = statistics.median(r["tps"])
        same = "-" if name.endswith(":free") else f"{r['same']}/{r['n']}"
        print(f"| {name} | {tps:.1f} | {f'{tps / base:.2f}x' if base else '-'} | {statistics.median(r['tpf']):.2f} | "
              f"{statistics.median(r['forced']):.2f} | {r['valid']}/{r['ended']} | {same} |")
    eng.close()


if __name__ == "__main__":
    main()
