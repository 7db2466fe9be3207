"""Remat's domain library: ONNX -> graph -> training graph -> cost model -> strategy ->
schedule -> plan -> simulation. No web, database or queue code lives here."""

__version__ = "0.1.0"
