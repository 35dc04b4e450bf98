"""``python -m llmlib.cli``: the ``llmlib`` command."""

import sys

from llmlib.cli import main

sys.exit(main())
