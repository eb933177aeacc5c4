"""First-divergence tracing: capture at step / phase / module / op level, offline comparison, hunt."""
