"""Stage 5, output: weights -> tables -> commit. ``tables`` builds the score table and sidecar
(columns from ``pairclean.schema``), ``folder`` is the output folder (where a worker writes,
the completion records, the manifest), ``lock`` the run lock, ``report`` and ``exports``
read finished outputs.
"""
