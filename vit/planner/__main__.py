import sys

from vit.planner.cli import main

sys.exit(main())
