"""The GPU tests count forgiven near-ties per test like the CPU suite."""

from sgl_embeds_testing.reference import at_most_one_forgiven_near_tie_per_test  # noqa: F401 (autouse)
