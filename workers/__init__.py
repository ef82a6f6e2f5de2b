"""pairclean workers (installed as ``pairclean_workers``): the job plan, the CLI, and Ray actors.

Depends on ``pairclean`` (the ``pipelines/`` library) only; never on the service.
"""
