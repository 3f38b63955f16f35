"""Federated training protocols over parties, with a recording transport and transcripts."""
