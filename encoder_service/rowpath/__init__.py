"""The row path: what both ends use to move rows, below the client, the core and the runtime (it imports only
`protocol`, `ranges` and `errors` of the package):

  raw_http.py   HTTP/1.1 on a plain socket, a fetch's body read with recv_into straight into place: the
                client's fetches, and a replica's fetch of another replica's rows (replicas/peers.py)
  host_pool.py  host memory for rows, handed back when the last tensor on it is gone and reused: the rows
                the server encodes (runtime/transfer.py) and those a client fetches without `out`
  cuda_ipc.py   the CUDA runtime calls of the fetch by IPC: the server's device row arena exports its
                handle (runtime/arena_memory.py), a consumer opens it and copies from it (client/ipc.py)
"""
