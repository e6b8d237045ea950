"""The demo's closing table, rendered from a real engine's critical path: its paging columns are the model's
page-ins and page-outs."""

from helpers import paged_timings
from lilo.timing.critical_path import flatten
from serve.cli.demo import paging_seconds, render_time_table


def test_the_demo_table_shows_each_models_paging_from_its_timing(tmp_path):
    timings, model_ids = paged_timings(tmp_path)
    metrics = {f"m{i}": flatten(timings.snapshot(model_id)) for i, model_id in enumerate(model_ids)}
    header, *rows = render_time_table(metrics).splitlines()
    assert header.split()[-5:] == ["in", "page", "out", "mean", "batch"]
    columns = {name: row.split() for name, row in zip(metrics, rows)}
    assert [row[0] for row in columns.values()] == list(metrics)
    # Each model was paged back in for its step, and paged another out to make room: both columns hold seconds.
    for name, row in columns.items():
        seconds = paging_seconds(metrics[name], "page_in"), paging_seconds(metrics[name], "page_out")
        assert all(value > 0 for value in seconds)
        assert [float(value) for value in row[6:8]] == [round(value, 2) for value in seconds]
    assert float(columns["m0"][-1]) >= 1.0  # the mean batch stays last
