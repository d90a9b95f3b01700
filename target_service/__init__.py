"""TargetService replica: a thin gRPC shell over `specdec.workers.TargetWorker` with a verify batcher."""
