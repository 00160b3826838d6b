"""The node's REST routes, one module per resource."""
