"""Heuristics: greedy eviction (``evict``, a registered strategy and the one-device warm
start of the exact strategies) and the multi-device placement heuristic (``placed``, the
multi-device warm start; not registered)."""
