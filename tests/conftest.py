"""Shared test setup: hypothesis profiles (CI runs the same number of examples as a developer)."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "coplan",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    print_blob=True,
)
settings.load_profile("coplan")
