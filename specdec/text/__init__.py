"""Text and vocabularies: tokenizers and prompt encoding, whether a draft can serve a target (their tokenizers and
vocabulary sizes), and structured output's grammars over a tokenizer's vocabulary."""
