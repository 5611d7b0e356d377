"""Tests of the package's base modules: memory regions, errors, schemas, time budgets."""
