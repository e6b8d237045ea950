"""The setup hook every worker of lilo's job runs: GC tuned for short pauses (cluster/worker_setup.py). Whether the
private head installs the hook at all is shown by test_loopback: its loopback rewrite is the same hook's other half."""

import json
import subprocess
import sys

from cluster.worker_setup import GC_THRESHOLDS

PROBE = """
import gc, json
before = gc.get_freeze_count()
from cluster.worker_setup import cluster_worker
cluster_worker()
print(json.dumps({"thresholds": gc.get_threshold(), "frozen_before": before, "frozen": gc.get_freeze_count()}))
"""


def test_a_worker_collects_young_objects_less_often_and_never_rescans_its_start():
    # In a process of its own: the settings are process-wide and would leak into the test session.
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    found = json.loads(out.stdout)
    assert tuple(found["thresholds"]) == GC_THRESHOLDS
    assert found["thresholds"][0] > 700  # CPython's default young threshold
    assert found["frozen_before"] == 0 and found["frozen"] > 10_000  # everything imported by then
