"""TargetService replica: a thin gRPC shell over `specdec.workers.target.TargetWorker` with a verify batcher."""
