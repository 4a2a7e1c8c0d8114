"""megatron_ext: Megatron-Core research code for the Composer 2 recipe on Kimi K2.5."""

import importlib.abc
import sys

from megatron_ext import lifetime as _lifetime

_lifetime.install()  # helper processes (checkpoint writers, multiprocessing servers) die with their parent


def _install_platform():
    from megatron_ext import platform

    platform.install()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then()` once the first import of module `name` has executed it. It adapts Megatron-Core to this
    machine (`platform.install()`) right after Megatron-Core loads and before anything uses it, so that a process
    that never loads it (a task generator, an evaluation report, any `--help`) starts in a fraction of a second
    instead of the ~3.5 s Megatron-Core's import costs; a process that does load it is bridged exactly as before."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        real, then = spec.loader, self.then

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                spec.loader = module.__loader__ = real  # the module keeps its own loader
                real.exec_module(module)
                then()

        spec.loader = Loader()
        return spec


if "megatron.core" in sys.modules:
    _install_platform()
elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport("megatron.core", _install_platform))

__version__ = "0.1.0"
