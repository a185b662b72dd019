"""Measuring this machine: hardware profiles, per-op factors, and predicted against measured."""
