"""GLUE tasks (MNLI)."""
