"""`moe-mesh bench`: a serving benchmark against a running mesh or set-ups it starts itself."""
