import sys

from fsdp_lab.cli import main

sys.exit(main())
