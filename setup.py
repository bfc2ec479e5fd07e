"""Install the top-level folders under one import namespace: ``lamina.<folder>``.

The repository layout is fixed (``services/``, ``libs/``, ``kernels/``, ``schemas/`` at the
root), but generic names like ``kernels`` clash with other installed packages, so each
folder is mapped to ``lamina.<folder>`` and ``lamina`` itself is an implicit namespace.
"""

from setuptools import find_packages, setup

TOP_LEVEL = ("services", "libs", "kernels", "schemas")

packages: list[str] = []
package_dir: dict[str, str] = {}
for folder in TOP_LEVEL:
    packages.append(f"lamina.{folder}")
    package_dir[f"lamina.{folder}"] = folder
    packages += [f"lamina.{folder}.{sub}" for sub in find_packages(folder)]

# The native CPU kernels are compiled from their source on first use.
package_data = {"lamina.kernels.cpu": ["*.cpp", "*.h"]}

setup(packages=packages, package_dir=package_dir, package_data=package_data)
