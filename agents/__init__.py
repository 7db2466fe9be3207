"""The node agent: a process on each compute node that talks to the API over HTTP only,
profiles operators on the node's devices and executes plans (PyTorch); see
docs/architecture.md, "Architecture"."""
