"""Benchmark suite: every decoding mode against ar and Hugging Face assisted generation (`python -m specdec_bench`)."""


def main(argv: list[str] | None = None) -> int:
    from specdec_bench.cli import main as _main  # lazy: importing a submodule (prompts) loads no torch

    return _main(argv)
