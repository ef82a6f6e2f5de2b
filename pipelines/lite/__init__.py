"""Tools, not a stage: pairclean-lite's training (``train``) and the Flickr8k reader (``evaldata``).
"""
