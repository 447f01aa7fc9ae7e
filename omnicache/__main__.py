"""``python -m omnicache``: the same command line as the ``omnicache`` script."""

from omnicache.demo.cli import main

raise SystemExit(main())
