"""zstandard's compressor and decompressor, as the store and the packs use them.

`import zstandard` runs the package's `__init__`, which imports `platform` (nine regular
expressions compiled, a named tuple built with `eval`) only to choose the C backend on CPython:
about 3 ms of CPU in every command that opens a store, a booth's start among them
(docs/benchmarks.md). Here the C backend is loaded by its own spec, under the name the package
would give it, so a later `import zstandard` (a test, a library) takes the very same module
and classes. Any other layout or interpreter gets the package, imported as usual.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

BACKEND = "zstandard.backend_c"


def _c_backend() -> ModuleType:
    loaded = sys.modules.get(BACKEND)
    if loaded is not None:
        return loaded
    try:
        package = importlib.util.find_spec("zstandard")
        if sys.implementation.name != "cpython" or package is None:
            raise ImportError("not the C backend's interpreter, or no zstandard")
        directories = package.submodule_search_locations or []
        if len(directories) != 1:
            raise ImportError("not the zstandard package's usual layout")
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(directories[0], "backend_c" + suffix)
            if os.path.isfile(path):
                break
        else:
            raise ImportError("no C backend in the zstandard package")
        spec = importlib.util.spec_from_file_location(BACKEND, path)
        if spec is None or spec.loader is None:
            raise ImportError("the C backend has no loader")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError, ValueError):
        import zstandard as package_module

        return package_module
    sys.modules[BACKEND] = module
    return module


TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    import zstandard as zstandard
else:
    zstandard = _c_backend()
