"""``python -m jsteer``: the ``jsteer`` command (:func:`jsteer.cli.run`)."""

from jsteer.cli import run

run()
