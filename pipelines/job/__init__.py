"""Stage 6, job: the loop over a job's shards. ``work`` is one worker's unit (score a shard,
apply the frozen calibration, write its tables), ``runner`` the driver (calibration phase,
scoring phase, retries, completion records), ``rescore`` re-weights without re-embedding,
``lifecycle`` the job states and exit codes.
"""
