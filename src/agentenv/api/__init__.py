"""The node's HTTP API (E2B-shaped routes, request and response models, the sandbox
proxy). It calls the orchestrator; it never touches runsc, network namespaces or files
on disk. ``agentenv.node`` wires it into the node's app."""
