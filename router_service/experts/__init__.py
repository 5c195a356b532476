"""Where experts run and how a layer reaches them: the MoE layer as one await (dispatch), replica
choice with hedging, ejection and a retry budget (replicas), the backends and their live placement
table, remote backends, live membership from the registry, and hot-expert tiering."""
