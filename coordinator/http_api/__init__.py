"""The OpenAI-compatible HTTP API (FastAPI), served beside the gRPC door and running requests on it in process.
"""
