"""The one error type of the search's inputs (statistics, trees, profiles), shared by its modules."""


class StatsError(ValueError):
    """Statistics that cannot be used, with a one-line reason."""
