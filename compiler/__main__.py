"""`python -m kiln` is the `kiln` command."""

import sys

from kiln.cli.commands import main

sys.exit(main())
