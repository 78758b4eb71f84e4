"""The transports over the one core (core/encoder.py): HTTP (http.py), gRPC (grpc_server.py), SGLang's encoder
protocol (sglang/), one error mapping (errors.py), bearer auth (auth.py), bounded request bodies (bodies.py), and
the service that builds the core and runs them on one loop (service.py)."""
