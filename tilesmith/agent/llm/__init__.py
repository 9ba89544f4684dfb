"""agent/llm stage."""
