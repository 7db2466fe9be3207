"""The exact strategies and their search: Checkmate's MILP and LP rounding (``checkmate``),
XEngine's multi-device MIQP (``xengine``); the search they share (``search``, its state in
``state``), and its phases: coarsening (``coarsen``), decomposition of large graphs
(``decompose``), XEngine's restrictions (``restrict``), the LP relaxation and RINS
(``rins``)."""
