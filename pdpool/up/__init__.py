"""``pdpool up``: an InferencePool on one machine, as local processes (``main`` is the command).

- ``pool``       the YAML → checked and parsed by the operator's schema and parser → the processes to run
- ``redis``      the pool's own ``redis-server`` (or checks on an external one)
- ``supervisor`` a child: prefixed output, state, restart with backoff, stop by process group
- ``state``      the state file that ``pdpool status`` reads
- ``main``       the command: start, progress, supervise, stop
"""
