"""The HTTP service: the FastAPI app (models, jobs, plans, profiles, nodes, the agent
protocol), persistence (SQLAlchemy, settings) and the dashboard; see docs/architecture.md,
"Architecture"."""
