"""Markers from what a test needs, so ``make unit`` runs without Redis or tritonserver.

- ``redis``: the test uses the ``redis_cluster`` fixture (tests that call
  ``start_redis_cluster``/``start_tls_redis_cluster`` or use a Redis-backed parameter
  carry the marker themselves);
- ``kafka``: the test uses the ``kafka_broker`` fixture (a Kafka-protocol broker);
- ``server``: every test under ``tests/e2e`` (they start a tritonserver).

``make unit`` runs ``-m "not redis and not kafka and not server and not slow"``; ``make
test`` runs everything.

``native_build``: the C++ test programs of tests/native, compiled once per session
(tests/native_build.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

E2E = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(config, items):
    """Add the ``redis``, ``kafka`` and ``server`` markers (see the module docstring)."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "redis_cluster" in fixtures:
            item.add_marker(pytest.mark.redis)
        if "kafka_broker" in fixtures:
            item.add_marker(pytest.mark.kafka)
        if E2E in Path(item.path).parents:
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def native_build(tmp_path_factory):
    """The objects of tests/native_build.py, compiled once for every test that links them."""
    from tests.native_build import build

    return build(tmp_path_factory.mktemp("native_build"))
