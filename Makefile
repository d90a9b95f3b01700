# One-command setup: every target installs what it needs into .venv from nothing (idempotent). The exact versions
# come from constraints.txt (pyproject.toml states ranges); `make demo` / `make serve` install the runtime only,
# the other targets everything (the bench, train and dev extras).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONSTRAINTS := constraints.txt
PIP_INSTALL := $(PY) -m pip install --quiet -c $(CONSTRAINTS)
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed
INSTALL_DEPS := pyproject.toml setup.py $(CONSTRAINTS)
PROTOS := $(wildcard proto/specdec/v1/*.proto)
PROTO_STAMP := specdec_rpc/pb/.generated
PROMPT ?= Explain how a hash map works, with an example in Python.

.PHONY: install install-runtime proto lock lint-imports test test-fast demo serve bench bench-quick distill-draft \
	distill-draft-gpu distill-feature-draft-gpu train-preverifier clean

install: $(STAMP) $(PROTO_STAMP)

install-runtime: $(RUNTIME_STAMP) $(PROTO_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch==2.13.0 (constraints.txt) resolves to the CPU wheel on disk; nothing here may pull a CUDA build.
# Building the editable install runs setup.py's hook, which generates the gRPC stubs into specdec_rpc/pb.
$(RUNTIME_STAMP): $(INSTALL_DEPS) | $(PY)
	$(PIP_INSTALL) -e .
	touch $(RUNTIME_STAMP)
	touch $(PROTO_STAMP)

$(STAMP): $(INSTALL_DEPS) | $(PY)
	$(PIP_INSTALL) -e '.[dev]'
	touch $(STAMP) $(RUNTIME_STAMP)
	touch $(PROTO_STAMP)

# a .proto changed: the same build hook regenerates the stubs (with the grpcio-tools pyproject's [build-system]
# pins, so a runtime-only .venv needs no grpcio-tools); `python scripts/gen_protos.py [--check]` is the hook's code
$(PROTO_STAMP): $(PROTOS) scripts/gen_protos.py setup.py | $(PY)
	$(PIP_INSTALL) --no-deps -e .
	touch $(PROTO_STAMP)

proto: $(PROTO_STAMP)

# rewrite constraints.txt from .venv (after changing a range in pyproject.toml and installing): exact versions of
# everything the project installs; torch keeps its plain version (the local +cpu label is the wheel path's business)
lock: install
	{ sed -n '/^#/p' $(CONSTRAINTS); $(PY) -m pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } \
		> $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)

# the architecture contracts in pyproject.toml ([tool.importlinter]): the core imports no transport, the layers
lint-imports: install
	$(VENV)/bin/lint-imports

# two workers, one per core; a test file stays on one worker (module fixtures: servers, Ray)
test: install lint-imports
	$(PY) -m pytest -ra --durations=15 -n 2 --dist loadfile

test-fast: install
	$(PY) -m pytest -ra -x -m "not slow"

demo: install-runtime
	$(VENV)/bin/specdec generate "$(PROMPT)" --mode sd --max-new-tokens 128

serve: install-runtime
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

# the prepared GPU run (docs/design/distillation.md, "The prepared GPU run"): on a GPU machine with python3 and torch
# (no .venv, no install), the target from its GGUF parts copied there; DRY_RUN=1: the same path on the CPU in < 2 min
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
distill-draft-gpu:
	PYTHONUNBUFFERED=1 PYTHONPATH=. $(GPU_PYTHON) -m specdec_train.distill.gpu_run $(if $(DRY_RUN),--dry-run) \
		$(if $(OUT),--out "$(OUT)") $(GPU_ARGS)

# the same for a one-layer feature draft (docs/design/feature_draft.md, "The prepared GPU run")
distill-feature-draft-gpu:
	PYTHONUNBUFFERED=1 PYTHONPATH=. $(GPU_PYTHON) -m specdec_train.distill.gpu_feature_run $(if $(DRY_RUN),--dry-run) \
		$(if $(OUT),--out "$(OUT)") $(GPU_ARGS)

# the pre-verifier is trained on fresh target text whose prompts the draft never saw: name the draft's training data
train-preverifier: install
	@test -n "$(DRAFT_SAMPLES)" || { echo "set DRAFT_SAMPLES to the draft's training samples (JSONL; repeat the flag" \
		"with PREVERIFIER_ARGS for more): their prompts are kept out of the pre-verifier's data"; exit 2; }
	$(VENV)/bin/specdec train-preverifier run --exclude-samples $(DRAFT_SAMPLES) $(PREVERIFIER_ARGS)

clean:
	rm -rf $(VENV) specdec_rpc/pb/*_pb2*.py specdec_rpc/pb/*_pb2*.pyi $(PROTO_STAMP) .pytest_cache
