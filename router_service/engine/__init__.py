"""The model and its continuous-batching engine: packed forward passes over a KV cache, sampling."""
