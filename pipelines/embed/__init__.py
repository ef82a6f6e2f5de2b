"""Stage 2, embed: samples -> embeddings. ``estimators`` loads the frozen towers (pairclean-lite,
open_clip), ``shard`` embeds one shard (similarities and vectors, rows in tar order),
``cpu_settings`` sets the process's CPU runtime for model work.
"""
