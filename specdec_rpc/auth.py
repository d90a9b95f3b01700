"""An API key on a gRPC service: calls to the guarded services must carry `authorization: Bearer <key>` metadata,
else UNAUTHENTICATED with a message saying what to send. Health and reflection stay open (probes and tools need no
key). The key is compared in constant time."""
from __future__ import annotations

import hmac

import grpc


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, key: str, services: tuple[str, ...], setting: str):
        """`services`: full service names to guard ("specdec.v1.GenerationService"); `setting`: where the key is
        configured, named in the refusal."""
        self.expected = f"Bearer {key}".encode()
        self.prefixes = tuple(f"/{s}/" for s in services)
        self.setting = setting

    def _authorized(self, metadata) -> bool:
        for k, v in metadata or ():
            if k.lower() == "authorization":
                return hmac.compare_digest((v if isinstance(v, bytes) else v.encode()), self.expected)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or not handler_call_details.method.startswith(self.prefixes)
                or self._authorized(handler_call_details.invocation_metadata)):
            return handler
        message = (f"missing or wrong API key: send the metadata 'authorization: Bearer <key>' (the key is "
                   f"{self.setting})")

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # an async generator, as a streaming handler is

        make = {"unary_unary": (grpc.unary_unary_rpc_method_handler, refuse),
                "unary_stream": (grpc.unary_stream_rpc_method_handler, refuse_stream),
                "stream_unary": (grpc.stream_unary_rpc_method_handler, refuse),
                "stream_stream": (grpc.stream_stream_rpc_method_handler, refuse_stream)}
        kind = next(k for k in make if getattr(handler, k))
        build, behavior = make[kind]
        return build(behavior, request_deserializer=handler.request_deserializer,
                     response_serializer=handler.response_serializer)
