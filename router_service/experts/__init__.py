"""Where experts run and how a layer reaches them: the dispatcher (scatter-gather, hedging,
ejection), remote backends, live membership from the registry, and hot-expert tiering."""
