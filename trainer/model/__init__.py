"""The GEM-shaped model built from a Workload spec."""
