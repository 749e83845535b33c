"""Import a package and every submodule it ships; fail if any forbidden top-level module got loaded.

Usage: python check_light_import.py PACKAGE FORBIDDEN [FORBIDDEN ...]
The package itself is allowed even when it is named among the forbidden ones.
"""

import importlib
import pkgutil
import sys


def import_all(package_name: str) -> list[str]:
    package = importlib.import_module(package_name)
    names = [package_name]
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}."):
        importlib.import_module(info.name)
        names.append(info.name)
    return names


def main() -> int:
    package_name, *forbidden = sys.argv[1:]
    imported = import_all(package_name)
    loaded_roots = {name.split(".")[0] for name in sys.modules}
    leaked = sorted(loaded_roots & (set(forbidden) - {package_name}))
    if leaked:
        print(f"FAIL: importing {package_name} loaded forbidden modules: {leaked}")
        return 1
    print(f"ok: {package_name} ({len(imported)} modules) loads none of {sorted(forbidden)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
