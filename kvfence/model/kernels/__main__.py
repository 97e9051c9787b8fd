"""`python -m kvfence.model.kernels`: build the C++ kernels now for the target `KernelOptions.from_env()` names
(exit 1 if they are on but cannot be built)."""

import logging
import sys

from kvfence.config import KernelOptions
from kvfence.model.kernels import build_dir, library

logging.basicConfig(level=logging.INFO)
options = KernelOptions.from_env()
built = library(options.kernels_march) if options.kernels else None
print(
    f"kernels: {'built in ' + str(build_dir(options.kernels_march)) if built else 'unavailable (torch path)'}"
)
sys.exit(0 if built is not None or not options.kernels else 1)
