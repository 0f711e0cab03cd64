"""Serving side: caches, block manager, scheduler, engine, runtime context."""

from pagedattn.runtime.context import PagedContext, current_context, paged_context  # noqa: F401
