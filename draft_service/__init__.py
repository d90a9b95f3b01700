"""DraftService replica: a thin gRPC shell over `specdec.workers.draft.DraftWorker` (see docs/api/grpc.md)."""
