"""Models: one decoder for every supported architecture, driven entirely by ModelConfig."""
