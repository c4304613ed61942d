"""The planner: estimate, search and validate parallel layouts analytically (docs/planner.md)."""
