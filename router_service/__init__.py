"""The router service: the model's dense part (attention, norms, gating, LM head), continuous batching,
and scatter-gather dispatch of tokens to expert backends."""
