"""`python -m ds_omni ...` (and `deepspeed --module ds_omni ...`) runs the CLI."""

import sys

from ds_omni.cli import main

sys.exit(main())
