"""The machinery: how a run runs, not what it computes (see each file's docstring)."""
