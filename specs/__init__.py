"""Bundled spec files (data): published architectures and tiny test specs."""
