"""Command-line experiments: thin launchers over the specjax library."""
