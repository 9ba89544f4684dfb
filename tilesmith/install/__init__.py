"""install stage."""
