"""agent/builtin stage."""
