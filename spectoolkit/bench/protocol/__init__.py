"""The measurement protocol: arms, warm-up, calibration, interleaved repeats, conditions."""
