"""The encode engine: admission with backpressure (engine.py: admit / Permit), packing queued images into ViT
batches by patch-token budget (scheduler.py), the one thread that owns the GPU and the one that waits for rows."""
