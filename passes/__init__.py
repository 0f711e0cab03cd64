"""FX passes that find attention and replace it with paged attention."""
