"""What the server and its clients agree on, imported by both ends (the client imports nothing else of the
server's but `ranges`, `errors` and the row path, `rowpath/`: its socket reader and host memory pool):

  wire.py           the fetch payload: header + raw little-endian rows (HTTP octet-stream, safetensors, gRPC)
  image_info.py     what encode answers per image, to and from its HTTP JSON
  release.py        what release answers: the count, and the malformed ids with why
  video_info.py     what encode answers per video, to and from its HTTP JSON; its frame groups' fetch items
  video_request.py  what a request asks of one video: source, caller id, options (one table for every transport)
  grpc_messages.py  encoder.v1 messages <-> wire headers and encode answers; gRPC trailing-metadata keys
  errors.py         the error-kind table: kind -> HTTP status, gRPC code, the exception a client raises
  proto/            the stubs generated from proto/encoder.proto (scripts/gen_proto.sh)
  shm.py            the shared-memory fetch target: file-name rule, where the rows go in the file
  timing.py         the x-timing-<name>-ms headers (HTTP) and trailing metadata (gRPC)
  dtypes.py         the row dtypes by name: the one name <-> torch.dtype table
"""
