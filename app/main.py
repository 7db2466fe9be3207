"""The FastAPI application. ``create_app()`` reads the settings from the environment
(``uvicorn --factory app.main:create_app``); ``remat serve`` passes its own."""

from __future__ import annotations

from fastapi import FastAPI

from app import dashboard, lifecycle, problem_details
from app.api import agent, executions, health, jobs, models, nodes, strategies
from app.database import Database
from app.limits import RequestLimits
from app.services import Dispatcher, Services
from app.settings import Settings
from app.storage import ModelStore
from app.task_queue import TaskQueue

UPLOAD_OVERHEAD = 1 << 20  # a model upload's body: the file, and multipart framing around it


def create_app(settings: Settings | None = None, dispatcher: Dispatcher | None = None) -> FastAPI:
    settings = settings or Settings()
    if problem := settings.enroll_token_problem():
        raise SystemExit(f"remat: error: {problem}")  # one line, before anything starts
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = Database(settings.database)
    if dispatcher is None:
        from workers.dispatch import dispatcher_for

        dispatcher = dispatcher_for(settings, db)
    app = FastAPI(
        title="Remat",
        version="1",
        summary="Optimal rematerialization and placement plans for training under memory budgets",
        lifespan=lifecycle.lifespan,  # its shutdown flag ends event streams and long polls
    )
    app.add_middleware(
        RequestLimits,
        max_body_bytes=settings.max_body_bytes,
        upload_bytes=settings.max_upload_bytes + UPLOAD_OVERHEAD,
        upload_paths={"/v1/models"},
        body_timeout_s=settings.body_timeout_s,
    )
    tasks = TaskQueue(db, settings.lease_s, settings.task_max_attempts)
    app.state.services = Services(settings, db, ModelStore(settings.model_dir), dispatcher, tasks)
    problem_details.install(app)
    app.include_router(health.router, responses=problem_details.responses(503))
    documented = problem_details.responses(400, 401, 404, 408, 413, 422)
    conflicts = problem_details.responses(409)
    app.include_router(
        models.router, responses=documented | conflicts | problem_details.responses(415)
    )
    app.include_router(
        jobs.router, responses=documented | conflicts | problem_details.responses(503)
    )
    app.include_router(executions.router, responses=documented | conflicts)
    app.include_router(nodes.router, responses=documented)
    app.include_router(strategies.router, responses=problem_details.responses(401))
    app.include_router(agent.router, responses=documented | conflicts)
    app.include_router(dashboard.router)
    return app
