import sys

from kvfence.cli import main

sys.exit(main())
