"""Mathematical-programming backends: a backend-neutral model (``model``), the contract of
a backend and the helpers backends share (``backend``), one module per solver, and a runner
that solves in a subprocess with progress and cancellation (``runner``, whose ``SOLVERS``
lists the backends by name)."""
