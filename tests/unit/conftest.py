"""Unit tier: one module (or a few) at a time, on the CPU, no servers of ours (a real redis-server where the
cache's Redis tier is under test, from tests/conftest.py)."""
