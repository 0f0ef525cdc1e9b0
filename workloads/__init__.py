"""Workload presets (YAML), shipped as package data."""
