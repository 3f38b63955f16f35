"""Attacks that consume an adversary's view (from a transcript) and return scored inferences."""
