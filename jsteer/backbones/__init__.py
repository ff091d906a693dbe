"""jsteer.backbones."""
