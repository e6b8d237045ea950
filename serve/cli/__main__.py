"""``python -m serve.cli``: how `lilo up --detach` and `lilo status` start their child processes."""

import sys

from serve.cli.commands import main

sys.exit(main())
