"""The fine-grained judge (issue 21): a second-stage image-text matching model and its cascade.

``edits`` makes one-word edits of captions (near-miss negatives, pure Python).
"""
