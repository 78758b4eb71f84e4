"""Engine tiers: tests that run vLLM's and SGLang's own code against our real service. Each engine's tests
run in a venv of their own (scripts/tiers/<engine>.sh builds it), never in the main `.venv`: there they are
skipped, since the engine is not installed."""
