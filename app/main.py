"""The FastAPI application. ``create_app()`` reads the settings from the environment
(``uvicorn --factory app.main:create_app``); ``remat serve`` passes its own."""

from __future__ import annotations

from fastapi import FastAPI

from app import dashboard, problems
from app.api import agent, executions, health, jobs, models, nodes
from app.context import Dispatcher, Services
from app.database import Database
from app.settings import Settings
from app.storage import ModelStore
from app.task_queue import TaskQueue


def create_app(settings: Settings | None = None, dispatcher: Dispatcher | None = None) -> FastAPI:
    settings = settings or Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = Database(settings.database)
    if dispatcher is None:
        from workers.dispatch import dispatcher_for

        dispatcher = dispatcher_for(settings, db)
    app = FastAPI(
        title="Remat",
        version="1",
        summary="Optimal rematerialization and placement plans for training under memory budgets",
    )
    tasks = TaskQueue(db, settings.lease_s, settings.task_max_attempts)
    app.state.services = Services(settings, db, ModelStore(settings.model_dir), dispatcher, tasks)
    problems.install(app)
    app.include_router(health.router)
    app.include_router(models.router)
    app.include_router(jobs.router)
    app.include_router(executions.router)
    app.include_router(nodes.router)
    app.include_router(agent.router)
    app.include_router(dashboard.router)
    return app
