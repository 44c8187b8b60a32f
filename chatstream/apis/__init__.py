"""One module per wire format, each behind the endpoint's ``Api`` protocol (endpoint.py)."""
