"""Meshes and the logical-axis rules table."""
