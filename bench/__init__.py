"""kvstrata benchmarks: ``kvstrata bench NAME [--json]``.

Each benchmark module exposes ``add_arguments(parser)`` and
``run(args) -> dict``; the dict holds the figures, the baseline measured in
the same run and their ratios. The ``kvstrata bench`` command adds the machine
description and prints a table or (``--json``) one JSON object; the
command's ``--help`` lists the benchmarks.
"""
