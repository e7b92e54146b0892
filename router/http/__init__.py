"""The HTTP edge: the aiohttp app, the fronts, parsing, responding, the error middleware."""
