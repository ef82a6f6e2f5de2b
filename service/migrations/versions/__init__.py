"""Alembic revisions of the job store (loaded by Alembic from their files, not imported)."""
