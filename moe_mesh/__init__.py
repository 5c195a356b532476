"""moe-mesh's command line and tooling: the `moe-mesh` CLI, the local launcher, operator views,
planning and developer tools. The services and shared code live in their own top-level packages
(`common`, `protos`, `router_service`, `expert_service`, `gateway`), which this package wires
together and which never import it.
"""
