"""Measuring: the protocol of a run (protocol/), its report (report/) and sweeps of runs (sweep/)."""
