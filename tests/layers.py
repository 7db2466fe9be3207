"""The layer of each test module (markers registered in pyproject.toml), and, run as a
script, the test files of the layers it names: ``python tests/layers.py service cli`` lists
the modules of those layers, so that a run of them collects no other module. No imports:
scripts/test reads it before any test starts.

A module not named here is in the fast in-process layer.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LAYERS: dict[str, set[str]] = {
    # real processes, PostgreSQL or Redis (tests/service.py starts them)
    "service": {
        "test_agent_protocol",
        "test_agent_trust",
        "test_agents",
        "test_api_fuzz",
        "test_api_validation",
        "test_embedded",
        "test_external_data_upload",
        "test_faults",
        "test_serve_lifecycle",
        "test_service",
        "test_submit",
        "test_upload_safety",
    },
    # the dashboard in Chromium, against ``remat serve``
    "browser": {"test_dashboard"},
    # the command line in subprocesses, no server or database: in-process layers, but CI
    # runs them beside the service layers (whose tests mostly wait on their processes)
    "cli": {"test_cli"},
    # in-process, but optimal solves, searches or CLI subprocesses of seconds per test
    "slow": {
        "test_cli",
        "test_coarsen",
        "test_cover",
        "test_decompose",
        "test_device_cover",
        "test_evict",
        "test_floor",
        "test_formulations",
        "test_max_batch",
        "test_moccasin",
        "test_optimal",
        "test_paging",
        "test_paging_execution",
        "test_pool_paging",
        "test_pools",
        "test_placed",
        "test_pytorch_gradients",
        "test_restrict",
        "test_solvers",
        "test_strategy_properties",
    },
}


def files(layers: list[str]) -> list[str]:
    """The test files of ``layers``, sorted, each once (``test_cli`` is in two layers)."""
    here = os.path.relpath(Path(__file__).parent)
    return sorted({os.path.join(here, f"{m}.py") for layer in layers for m in LAYERS[layer]})


if __name__ == "__main__":
    print("\n".join(files(sys.argv[1:])))
