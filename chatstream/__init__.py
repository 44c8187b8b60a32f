"""The deployed logic of the streaming chat function app (function_app.py only wires routes)."""
