"""Training a draft head on the target's own answers (DESIGN §8): data, the unrolled objective, the loop."""
