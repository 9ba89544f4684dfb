"""gate stage."""
