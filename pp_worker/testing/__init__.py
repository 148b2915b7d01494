"""Fixtures for tests, benchmarks and the demo model: a deterministic llama GGUF generator and its BPE tokenizer
builder. The worker and the driver never import this package."""
