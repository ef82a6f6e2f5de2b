"""Stage 1, read: a shard (local, HTTP, S3, GCS) -> samples. ``shards`` iterates a tar's pairs
with per-sample statuses, ``members`` reads one member by offset, ``decode`` turns image bytes
into model input (bounded pixels).
"""
