"""jsteer.convert."""
