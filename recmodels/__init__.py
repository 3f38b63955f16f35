"""Recommendation payloads: interaction datasets, loaders, splits, negative sampling, metrics, models."""
