# One-command setup: every target installs what it needs into .venv from nothing (idempotent).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/specdec/v1/*.proto)
PROTO_STAMP := specdec_rpc/pb/.generated
PROMPT ?= Explain how a hash map works, with an example in Python.

.PHONY: install proto lint-imports test test-fast demo serve bench bench-quick distill-draft train-preverifier clean

install: $(STAMP) $(PROTO_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch==2.13.0 resolves to the CPU wheel on disk; nothing here may pull a CUDA build
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(PROTO_STAMP): $(STAMP) $(PROTOS) scripts/gen_protos.py
	$(PY) scripts/gen_protos.py
	touch $(PROTO_STAMP)

proto: $(PROTO_STAMP)

# the architecture contracts in pyproject.toml ([tool.importlinter]): the core imports no transport, the layers
lint-imports: install
	$(VENV)/bin/lint-imports

# two workers, one per core; a test file stays on one worker (module fixtures: servers, Ray)
test: install lint-imports
	$(PY) -m pytest -ra --durations=15 -n 2 --dist loadfile

test-fast: install
	$(PY) -m pytest -ra -x -m "not slow"

demo: install
	$(VENV)/bin/specdec generate "$(PROMPT)" --mode pacer_pearl --max-new-tokens 128

serve: install
	$(VENV)/bin/specdec serve

bench: install
	$(VENV)/bin/specdec bench --markdown docs/benchmarks.md --json bench-results/bench.json --plot docs/benchmarks.png

bench-quick: install
	$(VENV)/bin/specdec bench --quick --json bench-results/bench-quick.json

# the shipped draft's recipe (docs/design/distillation.md, "Online distillation"): sized for one GPU (~20 min on an H100);
# on a CPU pass smaller numbers, e.g. DISTILL_ARGS="--gen-seconds 3600 --gen-batch 16 --steps 3000 --batch-size 8",
# or use the stored-label CPU pipeline: specdec distill-draft all
DISTILL_ARGS ?= --gen-seconds 530 --gen-batch 3072 --steps 6000 --batch-size 128 --warmup 200 --eval-every 500
distill-draft: install
	$(VENV)/bin/specdec distill-draft online --run make --out .cache-distill/draft $(DISTILL_ARGS)

# the pre-verifier is trained on fresh target text whose prompts the draft never saw: name the draft's training data
train-preverifier: install
	@test -n "$(DRAFT_SAMPLES)" || { echo "set DRAFT_SAMPLES to the draft's training samples (JSONL; repeat the flag" \
		"with PREVERIFIER_ARGS for more): their prompts are kept out of the pre-verifier's data"; exit 2; }
	$(VENV)/bin/specdec train-preverifier run --exclude-samples $(DRAFT_SAMPLES) $(PREVERIFIER_ARGS)

clean:
	rm -rf $(VENV) specdec_rpc/pb/*_pb2*.py specdec_rpc/pb/*_pb2*.pyi $(PROTO_STAMP) .pytest_cache
