"""What the server reads out of a model's text (tool calls, reasoning) or a body's output fields."""
