"""pairclean service (installed as ``pairclean_service``): the REST front end.

Depends on ``pairclean_workers`` and ``pairclean``; never loads a model itself.
Not implemented yet: see the project's issue on the REST service.
"""
