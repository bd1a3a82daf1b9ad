"""`python -m kiln` is the `kiln` command."""

import sys

from kiln.cli.main import main

sys.exit(main())
