"""Serving side: caches, block manager, scheduler, engine, runtime context."""
