"""Critical-path timing, all of it: where each model's step time went (queue wait vs execute vs capture/persist,
and how many commands shared each execution).

- ``critical_path``: the always-on observer a trainer's engine reports to, and its bounded accumulator;
- ``phase_stats``: the per-model, per-phase series it keeps;
- ``client``: what clients call, re-exported here as lilo's public timing API::

    from lilo.timing import log_critical_path, flush_critical_path
"""

from lilo.timing.client import critical_path_metrics, flush_critical_path, log_critical_path

__all__ = ["critical_path_metrics", "flush_critical_path", "log_critical_path"]
