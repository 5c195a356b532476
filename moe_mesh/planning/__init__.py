"""Planning deployments: the EPLB placement planner (`moe-mesh plan`) and deploy rendering and probing
(`moe-mesh deploy render`, `moe-mesh probe`)."""
