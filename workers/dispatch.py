"""How the API hands committed jobs to solvers: Celery when a broker is configured (with
the sweeper, ``workers/sweeper.py``, in a thread beside it), else the embedded dispatcher
(``remat serve`` without PostgreSQL or Redis). Both start with the app (``create_app``)."""

from __future__ import annotations

import json
import re

from celery import Celery

from app.database import Database
from app.services import Dispatcher
from app.settings import Settings
from workers.embedded import EmbeddedDispatcher
from workers.sweeper import Sweeper

JOB_ID = re.compile(r"[0-9a-f]{32}")


class CeleryDispatcher:
    """Jobs as Celery messages whose task id is the job id, so that the sweeper can tell
    from the broker which queued jobs still have a message (``pending``)."""

    def __init__(self, settings: Settings) -> None:
        from workers.celery_app import SOLVE_TASK, make_celery

        self.celery: Celery = make_celery(settings)
        self.task = SOLVE_TASK
        self.sweeper: Sweeper | None = None

    @classmethod
    def start(cls, settings: Settings, db: Database) -> CeleryDispatcher:
        """The dispatcher with its sweeper running (each API process has one)."""
        dispatcher = cls(settings)
        dispatcher.sweeper = Sweeper.start(settings, db, dispatcher)
        return dispatcher

    def stop(self) -> None:
        if self.sweeper is not None:
            self.sweeper.stop()

    def enqueue(self, job_id: str) -> None:
        self.celery.send_task(self.task, args=[job_id], task_id=job_id)

    def check(self) -> None:
        with self.celery.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=2)

    def pending(self) -> set[str]:
        """The jobs with a message in the broker: waiting in the queue, or delivered to a
        worker and not yet acknowledged (kombu's Redis ``unacked`` hash). Raises when the
        broker cannot be read; ``NotImplementedError`` for a broker other than Redis."""
        queue = self.celery.conf.task_default_queue
        with self.celery.connection_for_read() as connection:
            if connection.transport.driver_type != "redis":
                raise NotImplementedError(f"cannot list {connection.transport.driver_type}")
            channel = connection.default_channel
            client = channel.client
            keys = dict.fromkeys(channel._q_for_pri(queue, p) for p in channel.priority_steps)
            messages = [_loads(raw) for key in keys for raw in client.lrange(key, 0, -1)]
            for raw in client.hvals(channel.unacked_key):  # [message, exchange, routing key]
                delivered = _loads(raw)
                messages.append(delivered[0] if isinstance(delivered, list) else None)
        return {job for message in messages for job in _job_ids(message)}


def _loads(raw: bytes | str) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _job_ids(message: object) -> list[str]:
    """The job ids a Celery message is about: its task id (the job id) and the job id in
    its arguments (for a message sent with another task id)."""
    if not isinstance(message, dict) or not isinstance(message.get("headers"), dict):
        return []
    headers = message["headers"]
    return JOB_ID.findall(f"{headers.get('id', '')} {headers.get('argsrepr', '')}")


def dispatcher_for(settings: Settings, db: Database) -> Dispatcher:
    if settings.broker_url:
        return CeleryDispatcher.start(settings, db)
    return EmbeddedDispatcher.start(settings, db)
