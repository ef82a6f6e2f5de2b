"""The API's routers, one per resource: ``jobs`` (``/v1/jobs...``) and ``health``
(``/healthz``, ``/readyz``, ``/metrics``)."""
