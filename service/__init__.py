"""pairclean service (installed as ``pairclean_service``): the REST front end.

``app.create_app`` (FastAPI), ``store`` (jobs in SQLite/PostgreSQL), ``runner`` (each job a
``pairclean score`` process), ``security`` (API keys, URI allow-list), ``metrics``
(Prometheus), ``client`` (Python client), ``cli`` (the ``pairclean`` console entry point).
Depends on ``pairclean_workers`` (as a command) and the light parts of ``pairclean``;
never imports torch or loads a model.
"""
