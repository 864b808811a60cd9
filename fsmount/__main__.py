"""`python -m fsmount` runs the `modelfs` command line."""

from fsmount.cli import main

raise SystemExit(main())
