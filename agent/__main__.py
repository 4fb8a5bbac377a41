"""`python -m spotagent` is the `spotagent` command."""

from spotagent.cli import main

raise SystemExit(main())
