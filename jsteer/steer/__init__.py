"""jsteer.steer."""
