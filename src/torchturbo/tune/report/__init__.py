"""The tuner's report: the results file, the tables and plots, report.md and report.html, and
the trainers' settings beside turbo.toml (``write``), read from the search's outcome."""
