import sys

from gearflow.cli import main

sys.exit(main())
