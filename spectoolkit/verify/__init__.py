"""Verification of drafted tokens against the target (greedy and exact stochastic)."""
