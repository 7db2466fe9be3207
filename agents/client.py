"""The agent's HTTP client: the protocol's calls (``remat.agent_protocol``), with retries.

A server that cannot be reached, or answers 5xx, is retried with exponential back-off and
full jitter (many agents coming back after a server restart must not arrive together).
Answers that retrying cannot change raise at once: ``StaleLease`` (409, the task is no
longer ours), ``Rejected`` (4xx with the server's detail), ``Unauthorized`` (401: the
token is unknown, register again).
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
from pathlib import Path
from typing import Any

import httpx

from remat.agent_protocol import (
    Enrolled,
    Heartbeat,
    Lease,
    LeaseProof,
    LeaseRequest,
    Registration,
    ReportAccepted,
    Task,
    TaskProgress,
    TaskReport,
)

log = logging.getLogger("remat.agent")
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0


class Rejected(Exception):
    """The server refused the call (4xx); ``detail`` says why."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status, self.detail = status, detail


class Unauthorized(Rejected):
    pass


class StaleLease(Rejected):
    pass


class Stopped(Exception):
    """The agent is stopping: a call waiting to retry gives up."""


def backoff_s(attempt: int) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
    return random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt))


class AgentClient:
    def __init__(self, server: str, stop: threading.Event, timeout_s: float = 30.0) -> None:
        self.http = httpx.Client(base_url=server.rstrip("/"), timeout=timeout_s)
        self.stop = stop
        self.token: str | None = None

    def close(self) -> None:
        self.http.close()

    # --- the protocol ----------------------------------------------------------------

    def register(self, registration: Registration) -> Enrolled:
        enrolled = Enrolled.model_validate(
            self._call("POST", "/v1/agent/register", registration.model_dump(mode="json"))
        )
        self.token = enrolled.token
        return enrolled

    def heartbeat(self) -> Heartbeat:
        return Heartbeat.model_validate(self._call("POST", "/v1/agent/heartbeat", {}))

    def lease(self, wait_s: float) -> Task | None:
        body = LeaseRequest(wait_s=wait_s).model_dump()
        answer = self._call("POST", "/v1/agent/lease", body, timeout_s=wait_s + 30)
        return None if answer is None else Task.model_validate(answer)

    def renew(self, task_id: str, token: str) -> Lease:
        body = LeaseProof(lease_token=token).model_dump()
        return Lease.model_validate(self._call("POST", f"/v1/agent/tasks/{task_id}/renew", body))

    def progress(self, task_id: str, progress: TaskProgress) -> Lease:
        path = f"/v1/agent/tasks/{task_id}/progress"
        return Lease.model_validate(self._call("POST", path, progress.model_dump(), retries=2))

    def report(self, task_id: str, report: TaskReport) -> ReportAccepted:
        path = f"/v1/agent/tasks/{task_id}/report"
        return ReportAccepted.model_validate(self._call("POST", path, report.model_dump()))

    def release(self, task_id: str, token: str) -> None:
        body = LeaseProof(lease_token=token).model_dump()
        self._call("POST", f"/v1/agent/tasks/{task_id}/release", body, retries=2)

    def model_file(self, model_id: str, sha256: str, cache: Path) -> Path:
        """The model's ONNX file, downloaded once into ``cache`` and checked by sha256."""
        path = cache / f"{sha256}.onnx"
        if path.exists():
            return path
        cache.mkdir(parents=True, exist_ok=True)
        data = self._call("GET", f"/v1/agent/models/{model_id}", raw=True)
        if hashlib.sha256(data).hexdigest() != sha256:
            raise Rejected(0, f"model {model_id}: the downloaded bytes do not match its sha256")
        partial = path.with_suffix(".part")
        partial.write_bytes(data)
        partial.replace(path)
        return path

    # --- transport -------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        raw: bool = False,
        retries: int | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """The answer's JSON (None for 204), or its bytes with ``raw``; retries until the
        agent stops (or ``retries`` times) while the server is unreachable or failing."""
        attempt = 0
        while True:
            try:
                response = self.http.request(
                    method,
                    path,
                    json=body,
                    headers=self._headers(),
                    timeout=timeout_s or httpx.USE_CLIENT_DEFAULT,
                )
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 500:
                    return _answer(response, raw)
                failure = f"{response.status_code} {response.text[:200]}"
            if retries is not None and attempt >= retries:
                raise Rejected(503, f"server unavailable: {failure}")
            delay = backoff_s(attempt)
            log.warning("%s %s failed (%s); retrying in %.1f s", method, path, failure, delay)
            if self.stop.wait(delay):
                raise Stopped
            attempt += 1

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


def _answer(response: httpx.Response, raw: bool) -> Any:
    if response.status_code == 204:
        return None
    if response.is_success:
        return response.content if raw else response.json()
    try:
        detail = str(response.json().get("detail", response.text))
    except ValueError:
        detail = response.text
    error = {401: Unauthorized, 409: StaleLease}.get(response.status_code, Rejected)
    raise error(response.status_code, detail)
