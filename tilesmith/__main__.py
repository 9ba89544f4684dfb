"""``python -m tilesmith``: the same as the ``tilesmith`` console script (and ``python -m tilesmith.cli``)."""

import sys

from tilesmith.cli.main import main

sys.exit(main())
