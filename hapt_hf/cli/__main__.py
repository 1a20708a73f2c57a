"""``python -m hapt_hf.cli``: the same as the ``hapt-hf`` console script."""
import sys

from hapt_hf.cli import main

sys.exit(main())
