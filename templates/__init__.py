"""Jinja2 templates rendered by `onboard.codegen` (shipped as the package `onboard.templates`)."""
