"""Work in a subprocess beside a search (``remat.strategies.common.beside``): its result
arrives, a failure is reported with its reason, and work not done by the deadline is
stopped."""

from __future__ import annotations

import math
import time

from remat.strategies.common.beside import Beside


def test_the_result_arrives_over_the_pipe() -> None:
    assert Beside(math.sqrt, 16.0).result(time.monotonic() + 60) == (4.0, "")


def test_a_failure_is_reported_with_its_reason() -> None:
    value, why = Beside(int, "not a number").result(time.monotonic() + 60)
    assert value is None and why.startswith("ValueError: invalid literal")


def test_work_not_done_by_the_deadline_is_stopped() -> None:
    beside = Beside(time.sleep, 60.0)
    started = time.monotonic()
    value, why = beside.result(started + 0.5)
    assert value is None and why == "not done in time"
    assert not beside.running and time.monotonic() - started < 10
