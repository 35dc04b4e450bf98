"""``python -m llmlib``: the ``llmlib`` command."""

import sys

from llmlib.cli import main

sys.exit(main())
