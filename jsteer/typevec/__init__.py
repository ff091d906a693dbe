"""jsteer.typevec."""
