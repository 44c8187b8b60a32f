"""The chaos soak, ``make chaos``: soak.py."""
