"""Default ports, names and image shared by the services, the coordinator, the CLI and `deploy/` (tests read both)."""

COORDINATOR_PORT = 50051
DRAFT_PORT = 50061
TARGET_PORT = 50071
# the replicas' frame ports in deploy/ (specdec_rpc/frames.py): their gRPC port + 1
DRAFT_DATA_PORT = 50062
TARGET_DATA_PORT = 50072
COORDINATOR_HTTP_PORT = 8000  # the OpenAI-compatible API of `specdec serve` and deploy/ (off by default otherwise)
COORDINATOR_METRICS_PORT = 9400
DRAFT_METRICS_PORT = 9401
TARGET_METRICS_PORT = 9402
IMAGE_NAME = "ghcr.io/specdec/specdec"

DRAFT_SERVICE_NAME = "specdec.v1.DraftService"
TARGET_SERVICE_NAME = "specdec.v1.TargetService"
GENERATION_SERVICE_NAME = "specdec.v1.GenerationService"

DEFAULT_TARGET = "default-target"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"  # the id the OpenAI-compatible API serves it as
DEFAULT_DRAFT = "default-draft"

# prompt lookup beside the draft model (specdec/decoding/lookup.py): the shortest earlier n-gram match that proposes; 0:
# off
PROMPT_LOOKUP_MIN_NGRAM = 3

# draft weight quantization (specdec.modeling.quant): auto = int8 on a CPU serving bf16, else none
QUANT_MODES = ("auto", "none", "int8")
