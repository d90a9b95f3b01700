"""The mathematics of a round: sampling and logits processing, lossless verification (greedy, token-level, block),
prompt lookup, and PACER's pre-verifier with the rules that stop a draft."""
