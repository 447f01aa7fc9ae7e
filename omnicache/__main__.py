"""``python -m omnicache``: the same command line as the ``omnicache`` script."""

from omnicache.cli import main

raise SystemExit(main())
