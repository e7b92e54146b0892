"""The chat front's model-specific parts: the model's own chat template and tool-call parsers."""
