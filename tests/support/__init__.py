"""Test support: shared cases, checks and the named tolerances (no tests here)."""
