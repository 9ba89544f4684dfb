"""``python -m tilesmith.cli``: the same as the ``tilesmith`` console script."""

import sys

from tilesmith.cli.main import main

sys.exit(main())
