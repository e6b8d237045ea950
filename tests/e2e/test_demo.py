"""The main job, `lilo demo`, end to end against the session cluster, on its tiny model with SmolLM2's tokenizer
(the real demo's model would take minutes here)."""

import io
import json

from conftest import TINY_DIRECTORY
from serve.cli.demo import TASKS, run_demo


def test_the_demo_trains_four_clients_at_once_and_reports_where_the_time_went(local_cluster, tmp_path):
    out = io.StringIO()
    steps = 3
    samples = run_demo(local_cluster.api_url, home=tmp_path, base_model=str(TINY_DIRECTORY), steps=steps,
                       learning_rate=1e-2, out=out)
    text = out.getvalue()
    assert set(samples) == {task.name for task in TASKS}
    assert all(set(pair) == {"before", "after"} for pair in samples.values())
    # The loss table: a header and one row per step with a loss for each client.
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("step"))
    rows = [line.split() for line in lines[header + 1:header + 1 + steps]]
    assert [int(row[0]) for row in rows] == list(range(1, steps + 1))
    assert all(len(row) == 1 + len(TASKS) and all(float(v) >= 0 for v in row[1:]) for row in rows)
    # Every client logged its critical path every step (no W&B configured here: JSON lines in a file).
    logged = [json.loads(line) for line in (tmp_path / "demo-critical-path.jsonl").read_text().splitlines()]
    assert len(logged) == steps * len(TASKS)
    assert all(entry["lilo/forward_backward.execute.count"] >= 1 for entry in logged)
    # The closing table: one row per model, each with a mean batch of at least one command.
    table = lines[lines.index("Where each model's forward_backward time went, and its paging (seconds, whole run):")
                  + 2:]
    assert sorted(row.split()[0] for row in table) == sorted(task.name for task in TASKS)
    assert all(float(row.split()[-1]) >= 1.0 for row in table)
