"""`python -m kvfence.model.kernels`: build the C++ kernels now (exit 1 if they are on but cannot be built)."""

import logging
import sys

from kvfence.model.kernels import build_dir, enabled, ops

logging.basicConfig(level=logging.INFO)
built = ops()
print(f"kernels: {'built in ' + str(build_dir()) if built else 'unavailable (torch path)'}")
sys.exit(0 if built is not None or not enabled() else 1)
