"""Topology presets (YAML), shipped as package data; list them with ``coplan validate --list``."""
