"""After a job: RCSL-style pseudo-pairing of noisy pairs (``pairing``) with FAISS indexes (``ann``).
"""
