"""A study: the papers' claims tested on the runs of one sweep, from a claims file beside the sweep file.

``spec.py`` reads the claims file (metrics, claim parts, the study's GPU parts); ``runs.py`` finds the
study's runs and reads each metric of a run from its results rows; ``evaluations.py`` plans and records
the evaluations the metrics need; ``verdict.py`` holds the rule (a difference of arm means against its
standard error); ``report.py`` writes claims.json, claims.md and the figures; ``cli.py`` is
``hybrid-lm claims``. docs/RESULTS.md is the study this runs.
"""
