"""Draft distillation for the default pair (``python -m specdec_train.distill --help``).

Pipeline: ``generate`` (target continuations on a diverse, non-benchmark prompt set) -> ``teacher`` (top-k
soft labels from the target's logits, sharded and resumable) -> ``train`` (knowledge distillation into a small
Llama draft with a frequency-ranked output-vocabulary subset) -> ``evaluate`` (greedy agreement on held-out
prompts, per-token decode cost ratio at 1 thread) -> ``export`` (HF directory + model card).
See docs/design/distillation.md.
"""
