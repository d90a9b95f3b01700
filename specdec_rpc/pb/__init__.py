"""Generated protobuf/gRPC stubs for `proto/specdec/v1/*.proto` (package `specdec.v1`).

The `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` files are generated at install time by
`python scripts/gen_protos.py` (`make proto`) and are not committed. Import them as
`from specdec_rpc.pb import draft_pb2, draft_pb2_grpc`.
"""
