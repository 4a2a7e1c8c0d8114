"""megatron_ext: Megatron-Core research code for the Composer 2 recipe on Kimi K2.5."""

from megatron_ext import lifetime as _lifetime
from megatron_ext import platform as _platform

_lifetime.install()  # helper processes (checkpoint writers, multiprocessing servers) die with their parent
_platform.install()

__version__ = "0.1.0"
