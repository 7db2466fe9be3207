"""What every kind of strategy shares: the problem and result types (``problem``), R solved
for a given S (``rsolve``), prediction and choice among checkpoint policies (``policy``),
multi-device profiles without compiling (``profile``) and the memory floor (``floor``)."""
