"""`python -m specdec_train.preverifier` (the CLI's `specdec train-preverifier`): PACER pre-verifier training.

Pipeline: `collect` (run the draft and the target with the project's workers on training prompts, record the
draft's per-token features and per-token acceptance labels into `.cache-pacer/`) → `train` (per-token BCE,
held-out block AUC / precision / recall / false-stop / false-continue, θ tuned by simulating throughput on a dev
split with the measured costs) → write weights + card. `ablate` runs the fixed-γ vs pacer ablation in-process.
Benchmark prompts (HumanEval, the repository's chat benchmark set) are never training data. See docs/design/pacer.md.
"""
