"""``python -m app.cli``: the same as the ``inf-engine`` command."""

from app.cli.main import main

main()
