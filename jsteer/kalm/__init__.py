"""jsteer.kalm."""
