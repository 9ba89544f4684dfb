"""Example model definitions and scripts (random weights, no downloads)."""
