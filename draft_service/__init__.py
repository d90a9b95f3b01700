"""DraftService replica: a thin gRPC shell over `specdec.workers.DraftWorker` (see docs/services.md)."""
