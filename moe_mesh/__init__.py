"""Composition root: the `moe-mesh` CLI, checkpoint creation and the local launcher wire services together."""
