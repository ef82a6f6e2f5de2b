"""Stage 4, calibrate: similarities -> the frozen ``Calibration`` (beta, the mixture behind
``p_clean``, the weighting's parameters). ``calibration`` is where a job's calibration is
computed and frozen; ``p_clean`` fits the corpus-mixture ``p_clean`` curve (pure functions over arrays).
"""
