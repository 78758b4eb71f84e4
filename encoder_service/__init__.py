"""encoder_service: a vision-encoder microservice for Qwen-VL models.

Runs the vision towers of Qwen2-VL, Qwen2.5-VL and Qwen3-VL (MoE included), caches each
image's embedding rows by content hash, and serves them over HTTP and gRPC so that an LLM
server can fetch, per chunked-prefill chunk, only the rows it needs.
"""

__version__ = "0.1.0"

# Bumped whenever a change can alter embedding values (kernels, preprocessing, layouts).
# It is part of every cache key, so old entries are never served after such a change.
NUMERICS_VERSION = 1
