"""Broken kvxfer plugins: see the modules."""
