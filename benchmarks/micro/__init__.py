"""Engine speed: block hashing, the engine against transformers on the same weights, and
against vLLM's CPU build and transformers on a real model (docs/benchmarks.md)."""
