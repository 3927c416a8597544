"""Fuzzers of kit's file readers: settings shared by every fuzz test (fast, reproducible, no database)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fuzzlib

hypothesis = pytest.importorskip("hypothesis", reason="the fuzzers need hypothesis (kit's dev extra)")

# derandomize: the same cases on every run (a failure reproduces exactly; hypothesis prints the falsifying
# example); database=None: nothing is written outside tmp_path
hypothesis.settings.register_profile(
    "kit-fuzz", deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture, hypothesis.HealthCheck.too_slow,
                           hypothesis.HealthCheck.data_too_large])
hypothesis.settings.load_profile("kit-fuzz")

MAX_RSS_GROWTH = 1 << 30  # bytes: a reader that allocates for what a file claims, not what it holds, fails


@pytest.fixture(autouse=True)
def no_memory_blow_up():
    """The peak RSS of the process may not grow by more than 1 GiB during a fuzz test."""
    before = _peak_rss()
    yield
    grown = _peak_rss() - before
    assert grown < MAX_RSS_GROWTH, f"peak memory grew by {grown / 2**20:.0f} MiB during the test"


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)
