"""jsteer.kala."""
