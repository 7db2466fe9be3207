"""Mathematical-programming backends: a backend-neutral model (``model``), one module per
solver, and a runner that solves in a subprocess with progress and cancellation."""
