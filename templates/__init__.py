"""Jinja2 templates rendered by `onboard.adapt.codegen` (shipped as the package `onboard.templates`)."""
