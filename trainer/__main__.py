"""Entry point of `python -m spottrainer`."""

import sys

from .cli import main

sys.exit(main())
