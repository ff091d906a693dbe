"""jsteer.data."""
