"""gRPC health probe over (m)TLS for Kubernetes exec probes.

Kubelet's native gRPC probe cannot speak TLS (KEP-2727), so pods whose servers require TLS run this instead:
`python /etc/specdec/probe/grpc_tls_health.py --port 50061 --service specdec.v1.DraftService`.
Exit 0 iff grpc.health.v1 answers SERVING. Knows nothing about specdec itself; mounted from a ConfigMap so
the image does not need to change.
"""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--service", default="", help="health service name; '' is the server as a whole")
    p.add_argument("--ca", default="/etc/specdec/tls/ca.crt")
    p.add_argument("--cert", default="/etc/specdec/tls/tls.crt")
    p.add_argument("--key", default="/etc/specdec/tls/tls.key")
    p.add_argument("--server-name", default="", help="expected name in the server certificate (SAN)")
    p.add_argument("--insecure", action="store_true", help="plaintext (for tests)")
    p.add_argument("--timeout", type=float, default=3.0)
    a = p.parse_args(argv)

    target = f"{a.host}:{a.port}"
    if a.insecure:
        channel = grpc.insecure_channel(target)
    else:
        def read(path):
            with open(path, "rb") as f:
                return f.read()

        creds = grpc.ssl_channel_credentials(read(a.ca), read(a.key), read(a.cert))
        options = [("grpc.ssl_target_name_override", a.server_name)] if a.server_name else []
        channel = grpc.secure_channel(target, creds, options=options)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout
        )
    except grpc.RpcError as e:
        print(f"health check {target} {a.service!r}: {e.code().name}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not ok:
        print(f"health check {target} {a.service!r}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
