"""One local Ray cluster for a test module, started with one retry.

On a loaded 2-core machine a raylet can miss Ray's startup deadline ("The
current node timed out during startup"), most often right after the
previous module's cluster shut down. That is the machine, not the code
under test: the cluster is started once more after a clean shutdown.
"""

from __future__ import annotations

import ray


def start_local_ray() -> None:
    """``ray.init`` for the tests' local cluster (2 CPUs, no dashboard), retried once."""
    try:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
