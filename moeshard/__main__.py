"""`python -m moeshard`: the same as the `moeshard` script."""

import sys

from moeshard.entry import main

sys.exit(main())
