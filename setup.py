"""The wheel's packages (pyproject.toml holds everything else): the `llmgw` package, and the apps — top-level
packages in the repository — placed inside it as `llmgw/apps/<app>`, from where `llmgw/__init__.py` imports them."""

from setuptools import find_namespace_packages, setup

APPS = ("agents", "cluster", "gateway", "dashboard", "ground")


def found(top: str) -> list[str]:
    """A package and everything under it, the templates' and static files' directories too."""
    return [name for name in find_namespace_packages(include=[top, f"{top}.*"]) if "__pycache__" not in name]


packages = found("llmgw")
package_dir = {}
for app in APPS:
    packages += [f"llmgw.apps.{name}" for name in found(app)]
    package_dir[f"llmgw.apps.{app}"] = app

setup(packages=packages, package_dir=package_dir)
