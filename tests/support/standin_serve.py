"""`python -m tests.support.standin_serve DIR serve ARGS...`: `encoder-service serve ARGS` whose device row arena
is the host stand-in's (encoder_service/testing/host_ipc.py, its files in DIR), so that replicas run as
processes (tests/support/encoder_process.py: Replica(..., entry=standin_entry(DIR))) with the fetch by IPC on
the CPU, as tests/service/test_ipc_fetch.py runs it in-process (build_core(..., ipc_memory=...))."""

from __future__ import annotations

import functools
import sys


def main(argv: list[str]) -> int:
    from encoder_service import cli
    from encoder_service.api import service
    from encoder_service.testing.host_ipc import HostStandInMemory

    directory, args = argv[0], argv[1:]
    # Service.start builds its core with this module attribute: the stand-in's memory instead of cudaMalloc.
    service.build_core = functools.partial(service.build_core, ipc_memory=HostStandInMemory.factory(directory))
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
