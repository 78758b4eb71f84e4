"""Tests of the benchmarks' own code, beside it (pytest's testpaths name this folder, so scripts/test.sh's main
suite runs them): each benchmark's CPU smoke run (`--small`), its harness without a GPU, what the scripts share.
They may use tests/support/; nothing under tests/ imports benchmarks/ (tests/unit/test_layering.py)."""
