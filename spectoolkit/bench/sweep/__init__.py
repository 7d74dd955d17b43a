"""Sweeps: job identity and resume, the sweep table, the sweep report, the Hydra callback."""
