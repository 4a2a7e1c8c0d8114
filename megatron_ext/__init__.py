"""megatron_ext: Megatron-Core research code for the Composer 2 recipe on Kimi K2.5."""

from megatron_ext import platform as _platform

_platform.install()

__version__ = "0.1.0"
