"""A plugin whose module cannot be imported (a dependency that is not installed)."""

import kvxfer_dependency_that_is_not_installed  # noqa: F401
