"""The operator's surface: what the ``tensorhub`` command runs besides benchmarks --
the demo, ``status``, a long-running peer's roles and its Prometheus metrics, and
``publish``/``fetch`` of files."""
